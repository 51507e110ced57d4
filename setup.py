"""Install megatron_dsv; build the pybind11 CUDA extension from csrc/ when nvcc exists.

Environment variables:
  DSV_SKIP_CUDA_BUILD=1    never build the CUDA extension (pure Python/Triton install).
  DSV_FORCE_CUDA_BUILD=1   fail the install if the extension cannot be built.
  DSV_CUDA_ARCHS="90"      semicolon-separated compute capabilities (default "90").
  CUDA_HOME                CUDA toolkit root (default: directory above `which nvcc`).

The extension is bound with pybind11 over raw device pointers and a CUDA stream
handle, so it links only against the CUDA runtime, never torch's C++ ABI.
A missing nvcc never fails the install unless DSV_FORCE_CUDA_BUILD=1.
"""

import concurrent.futures
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
EXT_NAME = "megatron_dsv._C"


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _has_toolkit(root: Path) -> bool:
    return (root / "bin" / "nvcc").exists() and any(next((root / d).glob("libcudart.so*"), None) for d in ("lib64", "lib"))


def _cuda_home():
    """CUDA_HOME, else the toolkit around `which nvcc`, else /usr/local/cuda.

    `which nvcc` can be a wrapper script (e.g. /usr/local/bin/nvcc) whose parent
    holds no libcudart: such a guess is skipped.
    """
    if os.environ.get("CUDA_HOME"):
        return Path(os.environ["CUDA_HOME"])
    nvcc = shutil.which("nvcc")
    candidates = [Path(nvcc).resolve().parent.parent] if nvcc else []
    candidates.append(Path("/usr/local/cuda"))
    for root in candidates:
        if _has_toolkit(root):
            return root
    return None


class NvccBuildExt(build_ext):
    """Compile csrc/*.cu with nvcc and csrc/*.cpp with the host compiler, link one module."""

    def build_extension(self, ext):
        if ext.name != EXT_NAME:
            return super().build_extension(ext)
        try:
            self._build_cuda(ext)
        except Exception as err:  # a missing toolkit never fails a plain install
            if _flag("DSV_FORCE_CUDA_BUILD"):
                raise
            print(f"[megatron_dsv] skipping CUDA extension: {err}", file=sys.stderr)

    def _build_cuda(self, ext):
        import pybind11
        import sysconfig

        cuda_home = _cuda_home()
        if cuda_home is None or not (cuda_home / "bin" / "nvcc").exists():
            raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
        nvcc = str(cuda_home / "bin" / "nvcc")
        archs = [a.strip() for a in os.environ.get("DSV_CUDA_ARCHS", "90").split(";") if a.strip()]
        gencode = []
        for arch in archs:
            gencode += [f"-gencode=arch=compute_{arch},code=sm_{arch}"]
        includes = [f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
                    f"-I{cuda_home / 'include'}", f"-I{ROOT / 'csrc'}"]
        build_tmp = Path(self.build_temp) / "csrc"
        build_tmp.mkdir(parents=True, exist_ok=True)
        jobs = []
        for src in sorted(ext.sources):
            obj = build_tmp / (Path(src).name + ".o")
            if src.endswith(".cu"):
                cmd = [nvcc, "-c", src, "-o", str(obj), "-O3", "-std=c++17", "--use_fast_math",
                       "-Xcompiler", "-fPIC", "-lineinfo", *gencode, *includes]
            else:
                cmd = [os.environ.get("CXX", "c++"), "-c", src, "-o", str(obj), "-O3", "-std=c++17",
                       "-fPIC", "-fvisibility=hidden", *includes]
            jobs.append((cmd, str(obj)))
        # one nvcc per translation unit, in parallel (the kernels are split by dtype for this)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            for cmd, _ in jobs:
                print(" ".join(cmd))
            list(pool.map(lambda job: subprocess.check_call(job[0]), jobs))
        objects = [obj for _, obj in jobs]
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        libdirs = [cuda_home / "lib64", cuda_home / "lib", cuda_home / "targets" / "x86_64-linux" / "lib"]
        link = [os.environ.get("CXX", "c++"), "-shared", "-o", str(out), *objects,
                *[f"-L{d}" for d in libdirs if d.exists()], "-lcudart"]
        print(" ".join(link))
        subprocess.check_call(link)


def _extensions():
    if _flag("DSV_SKIP_CUDA_BUILD"):
        return []
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cpp"))
    if not sources:
        return []
    if _cuda_home() is None and not _flag("DSV_FORCE_CUDA_BUILD"):
        print("[megatron_dsv] nvcc not found: installing without the CUDA extension", file=sys.stderr)
        return []
    return [Extension(EXT_NAME, sources=sources)]


setup(
    name="megatron_dsv",
    version="0.1.0",
    description="DSV dynamic sparse attention for video DiT training, as a Megatron-LM plugin",
    packages=find_packages(include=["megatron_dsv", "megatron_dsv.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",  # megatron-core 0.16.1 needs it; torch.load defaults to weights_only=True from 2.6
        "megatron-core>=0.16.1,<0.20",
        "triton; platform_system == 'Linux' and platform_machine == 'x86_64'",
        "pybind11>=2.10",
        "numpy",
        "safetensors",
        "pillow",
        "packaging",
        "tensorboard",  # --tensorboard-dir, which the example launchers pass
        "psutil",  # megatron-core's asynchronous checkpoint writer
    ],
    extras_require={
        # the sources of megatron_dsv/data/rendered.py: game engines (content shipped in their wheels) and
        # OpenCV to decode the real camera footage that tools/fetch_footage.py fetches
        "video": ["vizdoom>=1.2", "ale-py>=0.9", "opencv-python-headless>=4.6"],
        "test": ["pytest>=7", "pytest-timeout", "matplotlib", "vizdoom>=1.2", "ale-py>=0.9",
                 "opencv-python-headless>=4.6"],
        "plots": ["matplotlib"],
    },
    setup_requires=["pybind11>=2.10"],
    ext_modules=_extensions(),
    cmdclass={"build_ext": NvccBuildExt},
    entry_points={"console_scripts": ["dsv-train=megatron_dsv.train:main"]},
)
