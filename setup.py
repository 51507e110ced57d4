"""Install megatron_dsv; build the pybind11 CUDA extension from csrc/ when nvcc exists.

Environment variables:
  DSV_SKIP_CUDA_BUILD=1    never build the CUDA extension (pure Python/Triton install).
  DSV_FORCE_CUDA_BUILD=1   fail the install if the extension cannot be built.
  DSV_CUDA_ARCHS="90"      semicolon-separated compute capabilities (default "90").
  DSV_CUDA_CACHE=DIR       where built extensions are kept for reuse (default build/cuda-ext-cache; 0: off).
  CUDA_HOME                CUDA toolkit root (default: directory above `which nvcc`).

A build is kept under a hash of csrc/, the compile and link commands and `nvcc --version`, and reused
while none of them changes: `pip install -e .` followed by `tools/run_tests.sh` (which reinstalls
with the test extras) compiles csrc/ once, not twice.

The extension is bound with pybind11 over raw device pointers and a CUDA stream
handle, so it links only against the CUDA runtime, never torch's C++ ABI.
A missing nvcc never fails the install unless DSV_FORCE_CUDA_BUILD=1.
"""

import concurrent.futures
import hashlib
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


def _cache_dir():
    """DSV_CUDA_CACHE, else build/cuda-ext-cache; None when DSV_CUDA_CACHE=0."""
    value = os.environ.get("DSV_CUDA_CACHE", "")
    if value.lower() in ("0", "false", "no", "off"):
        return None
    return Path(value) if value else ROOT / "build" / "cuda-ext-cache"


def _build_key(commands, nvcc: str) -> str:
    """Hash of every file in csrc/ (headers included), the commands (temporary paths stripped) and nvcc's version."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for cmd in commands:
        digest.update("\0".join(cmd).encode() + b"\n")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    digest.update(version.encode())
    return digest.hexdigest()[:32]


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
        out = Path(self.get_ext_fullpath(ext.name))
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
        libdirs = [cuda_home / "lib64", cuda_home / "lib", cuda_home / "targets" / "x86_64-linux" / "lib"]
        link = [os.environ.get("CXX", "c++"), "-shared", "-o", str(out), *[obj for _, obj in jobs],
                *[f"-L{d}" for d in libdirs if d.exists()], "-lcudart"]
        cached = self._cached_build(jobs, link, nvcc, build_tmp, out, pybind11)
        if cached is not None and cached.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(cached, out)
            print(f"[megatron_dsv] csrc/ and the build commands are unchanged: reusing the CUDA extension {cached}",
                  file=sys.stderr)
            return
        # one nvcc per translation unit, in parallel (the kernels are split by dtype for this)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            for cmd, _ in jobs:
                print(" ".join(cmd))
            list(pool.map(lambda job: subprocess.check_call(job[0]), jobs))
        out.parent.mkdir(parents=True, exist_ok=True)
        print(" ".join(link))
        subprocess.check_call(link)
        if cached is not None:
            try:  # a cache that cannot be written only costs the next install a rebuild
                cached.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(out, cached.with_suffix(".tmp"))
                os.replace(cached.with_suffix(".tmp"), cached)
            except OSError as err:
                print(f"[megatron_dsv] CUDA extension not cached ({err})", file=sys.stderr)

    @staticmethod
    def _cached_build(jobs, link, nvcc, build_tmp, out, pybind11):
        """Where this exact build is (or will be) kept, or None without a cache. The key ignores the
        temporary folders (pip builds in a fresh one each time) and names pybind11 by its version."""
        cache = _cache_dir()
        if cache is None:
            return None
        swaps = {str(build_tmp): "<tmp>", str(out): "<out>",
                 pybind11.get_include(): f"<pybind11 {pybind11.__version__}>"}

        def strip(arg):
            for old, new in swaps.items():
                arg = arg.replace(old, new)
            return arg

        commands = [[strip(a) for a in cmd] for cmd, _ in jobs] + [[strip(a) for a in link]]
        return cache / f"{_build_key(commands, nvcc)}-{out.name}"


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
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3.8", "matplotlib", "vizdoom>=1.2", "ale-py>=0.9",
                 "opencv-python-headless>=4.6", "six", "regex", "pyyaml", "pydantic",
                 "diffusers>=0.33", "safetensors"],
        "plots": ["matplotlib"],
        # what Megatron-LM's megatron.training imports beyond megatron-core (the patched Megatron-LM path)
        "megatron-lm": ["six", "regex", "pyyaml", "pydantic"],
        # Wan2.1 (models/wan*.py, tools/convert_checkpoint.py): diffusers' WanTransformer3DModel
        "wan": ["diffusers>=0.33", "safetensors"],
    },
    setup_requires=["pybind11>=2.10"],
    ext_modules=_extensions(),
    cmdclass={"build_ext": NvccBuildExt},
    entry_points={"console_scripts": ["dsv-train=megatron_dsv.train:main"]},
)
