"""Host side of the Triton kernels: tile configs, the inverse map, launches.

Configs are picked per (head dim, group size, block size, pass) in
``pick_config``; the H200 sweep in benchmarks/bench_sparse_attention.py
(``--tune``) measured the defaults (see benchmarks/NOTES_sparse_attention.md).
``cfg`` arguments override a pass's config for that sweep.

q, o, do are [B, H, T, D] and k, v [B, Hkv, TK, D]: T queries against TK keys
(TK != T for a context-parallel rank's queries against its gathered keys).
List entries index TK's tokens or its ceil(TK / BS) key blocks; query groups
tile T. Kernels mask query rows with T and key rows with TK.
"""

from __future__ import annotations

import math
import os
from typing import Dict, Optional, Tuple

import torch
import triton

from .checks import group_counts
from .packing import pack_token_lists, packed_row_chunks, token_pack_factor
from .triton_bwd import bwd_delta_kernel, bwd_kv_kernel, bwd_q_kernel
from .triton_fwd import LOG2E, sparse_attn_fwd_kernel, sparse_attn_fwd_kt_kernel

Config = Dict[str, int]

# (pass, D, G, BS) -> config set by a tuning sweep at run time; wins over the table below
CONFIG_OVERRIDES: Dict[Tuple[str, int, int, int], Config] = {}

# (G, BS) -> fused-backward config, D=128 only: where the fused (5-matmul) backward beat the
# split one on the H200 at S=64K and 16K, 90% sparse (sparse_attention-groups-h200-20261130.json):
# G=64/block 128: 25.6 vs 31.2 ms (1.22x), 16K 1.87 vs 2.17; G=32/block 64: 34.8 vs 42.3 (1.22x),
# 16K 2.45 vs 2.92. Small groups make the split's dq kernel run on 64- or 32-row tiles; the
# fused kernel's tiles don't depend on G. Elsewhere split won: G=128 by 9% (23.1 vs 25.2),
# and with 64-row key tiles (block 64) the dq atomics double per FLOP (G=128/64: 23.3 vs 42.3).
FUSED_FASTER: Dict[Tuple[int, int], Config] = {
    (64, 128): dict(BM=64, BN=128, num_warps=8, num_stages=2, DQ=1),
    (32, 64): dict(BM=32, BN=64, num_warps=4, num_stages=2, DQ=1),
}


def pick_config(kind: str, D: int, G: int, BS: int, keys_as_rows: bool = True) -> Config:
    """Tile sizes and launch shape for one pass: kind in {fwd, bwd_q, bwd_kv, bwd_kv_token, bwd_fused}.
    ``keys_as_rows=False``: the row-major forward's config where the default is the keys-as-rows one (``KT``)."""
    if (kind, D, G, BS) in CONFIG_OVERRIDES:
        return dict(CONFIG_OVERRIDES[(kind, D, G, BS)])
    big = D > 128  # 256: half-size key tiles to fit registers and shared memory
    # D <= 128 values: winners of the H200 sweep at S=64K, G=128, 90% sparsity (NOTES_sparse_attention.md).
    # D = 256 values: winners of the H100 tuning sweep at 64K, G = 128, 90% sparse, block lists of 128 and token
    # lists (run 19, sparse_attention-tune-d256-run19-h100-80gb-hbm3-20261206.json): forward 14.3 ms against the
    # earlier 28.1 (128-row query tiles), dq 21.1 against 36.8, dk/dv 69.4 against 85.2 (64-row tiles), token
    # forward 24.7 against 49.0, token dq 155.9 against 189.1 (three stages)
    if kind == "fwd":
        if BS == 0 and G == 32 and D == 128:
            # 128-key steps on 4 warps (the DSV artifact's shape): 17.65 ms against BN = 64's 20.40 and the
            # artifact's 18.13 at 64K, 90%, video lists, D = 128 (run 25, H100, --tune); D = 64 / 96 untimed
            cfg = dict(BM=32, BN=128, num_warps=4, num_stages=2)
        elif BS == 0:  # gathered rows: 4 warps won over 8 at D <= 128
            cfg = dict(BM=min(G, 128), BN=64, num_warps=8, num_stages=2) if big else \
                dict(BM=min(G, 128), BN=64, num_warps=4, num_stages=3)
        elif G == 32 and D == 128 and keys_as_rows:
            # keys as the MMA's rows (wgmma on a 32-query tile, the sum reduced once at the end): 17.97 / 17.80 ms
            # against the row-major 22.12 / 20.54 at 64K, 90%, blocks of 64 / 128 (run 19, H100). Token lists
            # stay row-major: there it measured slower (33.5 against 20.2 ms)
            cfg = dict(BM=32, BN=64, num_warps=4, num_stages=2, LAZY_L=1, KT=1)
        elif G == 32 and BS == 64 and not big:
            # row-major, two 64-blocks per 128-wide step (D = 128, H200: 22.6 vs 26.2 ms at 64K, 1.53 vs 1.73 at 16K;
            # at G=128 8.37 vs 8.60, within noise; at G=64 slower, 15.1 vs 12.8); kept where keys-as-rows is untimed
            cfg = dict(BM=32, BN=128, num_warps=8, num_stages=3)
        else:
            cfg = dict(BM=min(G, 128), BN=64 if big else BS, num_warps=8, num_stages=2 if big else 3)
    elif kind == "bwd_q":
        if BS == 0:  # one program per group: every extra tile of a group repeats the atomics
            cfg = dict(BM=min(G, 64 if big else 128), BN=32 if big else 64, num_warps=8, num_stages=3)
        else:
            cfg = dict(BM=min(G, 128), BN=64 if big else BS, num_warps=8, num_stages=1 if big else 2)
    elif kind == "bwd_kv":
        cfg = dict(BM=min(G, 64), BN=64, num_warps=4 if not big else 8, num_stages=2)
    elif kind == "bwd_kv_token":  # BN is fixed: the inverse map's key masks are BN bits (not tuned yet)
        cfg = dict(BM=min(G, 32 if big else 64), BN=TOKEN_TILE, num_warps=4 if not big else 8,
                   num_stages=1 if big else 2)
    elif kind == "bwd_fused":  # the dk/dv kernel's tiles; DQ: 1 = pointer atomics, 2 = TMA reduce-add
        if D == 128 and (G, BS) in FUSED_FASTER:
            return dict(FUSED_FASTER[(G, BS)])
        # 128-row key tiles halve the dq atomics per FLOP (25.2 vs 42.3 ms at G=128, 64K);
        # TMA reduce-add measured no better than pointer atomics (26.2 vs 25.2)
        bn = 128 if BS >= 128 and not big else 64
        cfg = dict(BM=min(G, 32 if big else 64), BN=bn, num_warps=8 if (big or bn == 128) else 4, num_stages=2,
                   DQ=1)
    else:
        raise ValueError(f"unknown pass {kind!r}")
    return cfg


BWD_MODES = ("auto", "split", "fused")
# keys per tile of the token lists' atomic-free dk/dv kernel: a group's keys in a tile are one int64 mask of
# TOKEN_TILE bits, and 32 keeps every mask below 2^32, so the map's int64 prefix sums cannot overflow
TOKEN_TILE = 32


def bwd_mode(G: int, BS: int, D: int) -> str:
    """The one place the block-level backward is chosen: ``DSV_SPARSE_BWD`` in
    {auto, split, fused}. split: dq kernel + inverse-map dk/dv kernel (7 matmuls, no atomics: the same
    bits on every run); fused: one inverse-map kernel adding dq with fp32 atomics (5 matmuls).
    Token lists take the dq kernel with dk/dv atomics.

    Deterministic algorithms (``torch.use_deterministic_algorithms(True)``, Megatron's
    ``--deterministic-mode``): block lists take split (its cost: none at the default G=128 / 128-key
    blocks, where auto takes split anyway; 1.22x the backward where fused measured faster, G=64 / 128 and
    G=32 / 64 at D=128); token lists take the dq kernel with dk/dv scattered as int64 fixed point
    (:func:`token_kv_mode`); an explicit ``fused`` has no deterministic kernel and raises (warns, with
    ``warn_only=True``), as torch's own ops do."""
    name = os.environ.get("DSV_SPARSE_BWD", "auto").strip().lower() or "auto"
    if name not in BWD_MODES:
        raise ValueError(f"DSV_SPARSE_BWD must be one of {BWD_MODES}; got {name!r}")
    deterministic = torch.are_deterministic_algorithms_enabled()
    if BS == 0:  # the dq kernel, then dk/dv by atomics or (deterministic) by the token inverse map
        return "split"
    if deterministic:
        if name == "fused":  # asked for by name: raises, or (warn_only) runs as asked
            _nondeterministic("DSV_SPARSE_BWD=fused adds dQ with fp32 atomics; unset it (auto takes the "
                              "atomic-free split backward under deterministic algorithms)")
            return "fused"
        return "split"
    if name != "auto":
        return name
    return "fused" if D == 128 and (G, BS) in FUSED_FASTER else "split"


def _nondeterministic(why: str) -> None:
    msg = ("sparse attention backward is not deterministic here, but torch.use_deterministic_algorithms(True) "
           f"(Megatron's --deterministic-mode) asks for it: {why}")
    if torch.is_deterministic_algorithms_warn_only_enabled():
        import warnings

        warnings.warn(msg, stacklevel=3)
    else:
        raise RuntimeError(msg)


def _launch_opts(cfg: Config) -> Dict[str, int]:
    return dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _bd(D: int) -> int:
    return triton.next_power_of_2(D)


def _pack_factor(pack: Optional[int], G: int, BS: int) -> int:
    """``pack`` (None: 1) checked against the lists: only token lists pack, into a power-of-two number of groups
    of at most 128 rows in all (the packed group is the kernels' query tile)."""
    P = 1 if pack is None else int(pack)
    if P <= 1:
        return 1
    if BS != 0:
        raise ValueError(f"pack={P}: only token lists (block_size 0) pack, got block_size={BS}")
    if P & (P - 1) or P * G > 128:
        raise ValueError(f"pack={P}: must be a power of two with pack * group_size <= 128 (group_size={G})")
    return P


def _packed(kv_indices, kv_counts, G: int, BS: int, TK: int, pack: Optional[int]):
    """``(kv_indices, bits, kv_counts, G, GB)`` the kernels take: the lists as given (bits None, GB 0), or
    packed into groups of ``pack * G`` rows (:mod:`.packing`; pack None: 1)."""
    P = _pack_factor(pack, G, BS)
    if P == 1:
        return kv_indices, None, kv_counts, G, 0
    idx, bits, counts = pack_token_lists(kv_indices, kv_counts, G, P, TK)
    return idx, bits, counts, P * G, G


def sparse_fwd(q, k, v, kv_indices, kv_counts, G: int, BS: int, scale: float,
               cfg: Optional[Config] = None, pack: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """o [B, H, T, D] in q's dtype and lse [B, H, T] fp32 (log2 units); k, v [B, Hkv, TK, D].
    ``pack``: token lists packed P groups at a time (:func:`_packed`; cfg is then the packed group's). None:
    not packed (the packed forward measured no faster: only the backward packs, :mod:`.packing`)."""
    B, H, T, D = q.shape
    TK = k.shape[2]
    if cfg and cfg.get("KT") and _pack_factor(pack, G, BS) > 1:
        raise ValueError(f"cfg KT=1 (keys as the MMA's rows) takes unpacked lists; got pack={pack}")
    kv_indices, bits, kv_counts, G, GB = _packed(kv_indices, kv_counts, G, BS, TK, pack)
    NG = kv_indices.shape[2]
    cfg = cfg or pick_config("fwd", D, G, BS)
    o = torch.empty_like(q)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    grid = (NG * (G // cfg["BM"]), B * H)
    if cfg.get("KT"):  # keys as the MMA's rows (query tiles under 64 rows; unpacked lists, checked above)
        sparse_attn_fwd_kt_kernel[grid](
            q, k, v, o, lse, kv_indices, _kernel_counts(kv_counts, NG), T, TK, NG, kv_indices.shape[3],
            scale * LOG2E, H=H, HR=H // k.shape[1], K=D, BD=_bd(D), G=G, BM=cfg["BM"], BN=cfg["BN"], BS=BS,
            EVEN_T=_even_keys(TK, BS), LAZY_L=int(cfg.get("LAZY_L", 0)), **_launch_opts(cfg))
        return o, lse
    sparse_attn_fwd_kernel[grid](
        q, k, v, o, lse, kv_indices, kv_indices if bits is None else bits, _kernel_counts(kv_counts, NG),
        T, TK, NG, kv_indices.shape[3], scale * LOG2E,
        H=H, HR=H // k.shape[1], K=D, BD=_bd(D), G=G, BM=cfg["BM"], BN=cfg["BN"], BS=BS,
        EVEN_T=_even_keys(TK, BS), GB=GB, **_launch_opts(cfg))
    return o, lse


def _kernel_counts(kv_counts: torch.Tensor, NG: int) -> torch.Tensor:
    """The kernels read one count per (batch, head, query group): int32 ``[B, H, NG]``, contiguous."""
    return group_counts(kv_counts, NG).contiguous()


def _even_keys(TK: int, BS: int) -> bool:
    """The kernels' EVEN_T: no key block is partial (always true for token lists)."""
    return BS == 0 or TK % BS == 0


INT32_KEYS_BELOW = 2**31 - 1  # the inverse map's sort keys are int32 below this many (batch, head, block) keys


def build_inverse_map(kv_indices: torch.Tensor, kv_counts: torch.Tensor, nkb: int):
    """CSR map key block -> query groups, per (batch, head), groups ascending.

    kv_indices int32 [B, H, NG, Kmax] (NG groups of the queries), kv_counts int32 [B, H] or [B, H, NG];
    nkb = ceil(TK / BS), the number of key blocks of the KEY length.

    inv_ptr [B*H*nkb + 1] int32, inv_grp [B*H*NG*Kmax] int32 (tail unused).
    One stable sort of the flat entries; no host sync, so it can run inside a
    captured graph. Padding entries sort last and are never pointed at.

    It runs inside the backward, at the step's memory peak, so it keeps few and narrow temporaries:
    int32 keys (``B*H*nkb`` < 2^31 for any shape that fits a GPU), the padding marked in place, each
    temporary freed once used, the sort's int64 order turned into group ids in place. At its peak
    (the sort) it holds about 16 bytes per list entry beside the sort's own workspace; with int64
    keys and out-of-place steps it held about 41 (by count of the live tensors, not measured): at
    128K tokens, 16 heads and 205 of 1024 blocks kept, 54 MB instead of 138 MB.
    """
    B, H, NG, KM = kv_indices.shape
    dev = kv_indices.device
    n_keys = B * H * nkb
    key_dtype = torch.int32 if n_keys < INT32_KEYS_BELOW else torch.int64
    pad = torch.arange(KM, device=dev, dtype=torch.int32) >= group_counts(kv_counts, NG)[..., None]
    base = torch.arange(B * H, device=dev, dtype=key_dtype).view(B, H, 1, 1) * nkb
    key = kv_indices.to(key_dtype) + base  # a new tensor: the lists stay untouched
    key.masked_fill_(pad, n_keys)
    del pad
    # flat order is (b, h, g, j): a stable sort keeps each key block's groups ascending
    key_sorted, order = torch.sort(key.reshape(-1), stable=True)
    del key
    bounds = torch.arange(n_keys + 1, device=dev, dtype=key_dtype)
    inv_ptr = torch.searchsorted(key_sorted, bounds).to(torch.int32)
    del key_sorted, bounds
    inv_grp = order.div_(KM, rounding_mode="floor").remainder_(NG).to(torch.int32)
    return inv_ptr, inv_grp


def build_token_inverse_map(kv_indices: torch.Tensor, kv_counts: torch.Tensor, TK: int, BN: int = TOKEN_TILE):
    """CSR map key tile -> (query group, mask of its listed keys in the tile), per (batch, head), groups ascending.

    Token lists: kv_indices int32 [B, H, NG, Kmax] key ids in [0, TK), kv_counts int32 [B, H] or [B, H, NG];
    tiles of BN (<= 32) consecutive keys, nkt = ceil(TK / BN) of them.

    inv_ptr [B*H*nkt + 1] int32; inv_grp int32 and inv_bits int64 [B*H*NG*Kmax] (tail unused): entry e is a
    group listing keys of its tile, bit j of inv_bits[e] set when it lists key ``tile * BN + j``. One sort of
    the flat entries and integer prefix sums (a group's keys in a tile are distinct bits, so their sum is
    their union), gathers and searches: no atomics and no host sync, the same map on every run.
    """
    if not 16 <= BN <= TOKEN_TILE:
        raise ValueError(f"token inverse map: BN must be in [16, {TOKEN_TILE}] (one int64 mask per entry), got {BN}")
    B, H, NG, KM = kv_indices.shape
    dev = kv_indices.device
    nkt = triton.cdiv(TK, BN)
    n_keys = B * H * nkt * NG  # one sort key per (batch*head, tile, group); padding sorts after all of them
    ids = kv_indices.long()
    valid = torch.arange(KM, device=dev) < group_counts(kv_counts, NG)[..., None]
    bh = torch.arange(B * H, device=dev).view(B, H, 1, 1)
    grp = torch.arange(NG, device=dev).view(1, 1, NG, 1)
    key = ((bh * nkt + ids // BN) * NG + grp).masked_fill_(~valid, n_keys).reshape(-1)
    bits = torch.bitwise_left_shift(torch.ones_like(ids), ids % BN).masked_fill_(~valid, 0).reshape(-1)
    del ids, valid
    key_sorted, order = torch.sort(key)
    del key
    bits = bits[order]
    del order
    E = key_sorted.numel()
    # entry e (1-based) spans the sorted items up to its last one, ends[e - 1]: its mask is the running sum of the
    # bits there minus the running sum at the previous entry's end (every mask < 2^32: no overflow in E items)
    seg = torch.ones(E, dtype=torch.int32, device=dev)
    seg[1:] = (key_sorted[1:] != key_sorted[:-1]).to(torch.int32)
    seg = torch.cumsum(seg, 0, dtype=torch.int32)  # the entry of every sorted item, nondecreasing
    entries = torch.arange(1, E + 1, device=dev, dtype=torch.int32)
    ends = torch.searchsorted(seg, entries, right=True).sub_(1)  # the last item of each entry (E - 1 past the end)
    used = entries <= seg[-1:]  # the tail past the last entry is unused
    del seg, entries
    total = torch.cumsum(bits, 0)
    del bits
    inv_bits = total[ends]
    inv_bits[1:] -= inv_bits[:-1].clone()
    inv_bits.masked_fill_(~used, 0)
    del total
    inv_key = torch.where(used, key_sorted[ends], n_keys)
    del key_sorted, ends, used
    inv_grp = inv_key.remainder(NG).to(torch.int32)
    bounds = torch.arange(B * H * nkt + 1, device=dev, dtype=torch.int64) * NG
    inv_ptr = torch.searchsorted(inv_key, bounds).to(torch.int32)
    return inv_ptr, inv_grp, inv_bits


TOKEN_KV_MODES = ("inverse", "fixed")


def token_kv_mode() -> str:
    """Token lists' deterministic dK/dV, ``DSV_TOKEN_KV_BWD`` in {inverse, fixed}: inverse (the default) walks the
    token inverse map over 32-key tiles; fixed is the dq kernel's scatter as int64 fixed-point atomics (integer
    sums do not depend on the order the atomics land in). Against the atomic backward (D=128, 64K, 90% sparse,
    G = 32 / 64 / 128; ``sparse_attention-sweep-token-run15-{video-,}h100-80gb-hbm3-20261205.json``, H100): on
    video-shaped lists inverse costs 1.33 / 1.58 / 2.18x and fixed 2.84 / 2.93 / 3.26x (H200: 1.26-2.09x and
    2.63-3.04x); on random lists inverse 3.8 / 5.2 / 8.6x and fixed 4.0 / 4.1 / 4.1x. A DSV list keeps each cube's
    neighbourhood, so neighbouring groups share their key tiles and the walk is the cheaper; fixed is bounded
    (~4x) whatever the lists, the choice for lists without locality."""
    name = os.environ.get("DSV_TOKEN_KV_BWD", "inverse").strip().lower() or "inverse"
    if name not in TOKEN_KV_MODES:
        raise ValueError(f"DSV_TOKEN_KV_BWD must be one of {TOKEN_KV_MODES}; got {name!r}")
    return name


def sparse_bwd(do, q, k, v, o, lse, kv_indices, kv_counts, G: int, BS: int, scale: float,
               atomic_kv: Optional[bool] = None, cfg_q: Optional[Config] = None,
               cfg_kv: Optional[Config] = None, mode: Optional[str] = None, token_kv: Optional[str] = None,
               pack: Optional[int] = None):
    """dq, dk, dv. Token lists (or atomic_kv=True) scatter dk/dv with fp32 atomics, except under
    deterministic algorithms (or atomic_kv=False), where token lists take ``token_kv`` (None: :func:`token_kv_mode`):
    "fixed" (the same scatter as int64 fixed point, :func:`fixed_point_scales`) or "inverse" (the token
    inverse map, ``bwd_kv_kernel`` with BS = 0); block lists take the atomic-free inverse-map kernel, after the
    dq kernel (mode split) or adding dq itself with atomics (mode fused; cfg_kv then
    overrides the fused config). mode None: ``bwd_mode``. q, o, do [B, H, T, D]; k, v [B, Hkv, TK, D].
    q and k must be contiguous; do, v and o may have any strides: the kernels read transient
    contiguous copies (o's only until delta is computed). dq, dk, dv are contiguous. ``pack``: token lists
    packed as in :func:`sparse_fwd` for the dq kernel (and its dK/dV scatter; None: :func:`token_pack_factor`,
    ``DSV_TOKEN_PACK``); the inverse walk takes the lists as given."""
    B, H, T, D = q.shape
    TK = k.shape[2]
    if token_kv is not None and token_kv not in TOKEN_KV_MODES:
        raise ValueError(f"sparse_bwd: token_kv must be one of {TOKEN_KV_MODES} or None, got {token_kv!r}")
    explicit = atomic_kv is not None or mode is not None  # asked for by the caller: bwd_mode checked neither
    if atomic_kv is None:
        atomic_kv = BS == 0 and not torch.are_deterministic_algorithms_enabled()
    mode = mode or bwd_mode(G, BS, D)
    if explicit and torch.are_deterministic_algorithms_enabled() and (atomic_kv or (mode == "fused" and BS)):
        _nondeterministic("atomic_kv=True scatters dK/dV with fp32 atomics" if atomic_kv else
                          "mode='fused' adds dQ with fp32 atomics")
    do, v = do.contiguous(), v.contiguous()
    if mode == "fused" and not atomic_kv and BS:  # token lists have no fused kernel: their split path below
        if cfg_kv is not None and cfg_kv["BN"] > BS:
            raise ValueError(f"fused backward: key tile BN={cfg_kv['BN']} must not exceed block_size={BS}")
        return _sparse_bwd_fused(do, q, k, v, o, lse, kv_indices, kv_counts, G, BS, scale, cfg_kv)
    hkv = k.shape[1]
    fixed = BS == 0 and not atomic_kv and (token_kv or token_kv_mode()) == "fixed"
    fx, inv = fixed_point_scales(q, k, v, do, scale) if fixed else (None, None)
    # o only feeds delta inside the dq kernel: its contiguous copy (if any) dies with that call
    # the dq kernel on packed lists (if asked) when it also scatters dK/dV; before the inverse walk, on the lists
    pack = (token_pack_factor(G, BS) if pack is None else pack) if (atomic_kv or fixed) else 1
    dq, delta, dk32, dv32 = sparse_bwd_q(do, q, k, v, o.contiguous(), lse, kv_indices, kv_counts, G, BS, scale,
                                         2 if fixed else int(bool(atomic_kv)), cfg_q, fx_scale=fx, pack=pack)
    if atomic_kv:
        return dq, dk32.to(k.dtype), dv32.to(v.dtype)
    if fixed:  # int64 fixed point back to floats: times 1 / 2^e (NaN where an input was not finite)
        return (dq, (dk32.to(torch.float32) * inv[:, :, 0, None, None]).to(k.dtype),
                (dv32.to(torch.float32) * inv[:, :, 1, None, None]).to(v.dtype))
    if BS == 0:
        return (dq, *_sparse_bwd_token_kv(do, q, k, v, lse, delta, kv_indices, kv_counts, G, scale, cfg_kv))
    nkb = math.ceil(TK / BS)
    inv_ptr, inv_grp = build_inverse_map(kv_indices, kv_counts, nkb)
    cfg_kv = cfg_kv or pick_config("bwd_kv", D, G, BS)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    bwd_kv_kernel[(nkb * (BS // cfg_kv["BN"]), B * hkv)](
        q, k, v, do, lse, delta, dk, dv, dq, inv_ptr, inv_grp, inv_grp, T, TK, nkb, scale * LOG2E, scale,  # no bits
        BM=cfg_kv["BM"], BN=cfg_kv["BN"], DQ=0, H=H, HR=H // hkv, K=D, BD=_bd(D), G=G, BS=BS,
        **_launch_opts(cfg_kv))
    return dq, dk, dv


def _sparse_bwd_token_kv(do, q, k, v, lse, delta, kv_indices, kv_counts, G: int, scale: float,
                         cfg: Optional[Config] = None):
    """Token lists' dk, dv without atomics (after the dq kernel, which wrote delta)."""
    B, H, T, D = q.shape
    TK, hkv = k.shape[2], k.shape[1]
    cfg = cfg or pick_config("bwd_kv_token", D, G, 0)
    inv_ptr, inv_grp, inv_bits = build_token_inverse_map(kv_indices, kv_counts, TK, cfg["BN"])
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    nkt = triton.cdiv(TK, cfg["BN"])
    bwd_kv_kernel[(nkt, B * hkv)](  # DQ=0: the dq32 slot (dk here) is never touched
        q, k, v, do, lse, delta, dk, dv, dk, inv_ptr, inv_grp, inv_bits, T, TK, nkt, scale * LOG2E, scale,
        H=H, HR=H // hkv, K=D, BD=_bd(D), G=G, BS=0, BM=cfg["BM"], BN=cfg["BN"], DQ=0, **_launch_opts(cfg))
    return dk, dv


def fixed_point_scales(q, k, v, do, sm_scale: float):
    """The token lists' deterministic dK/dV scatter in int64 fixed point: ``(scales, inverse)``, float32
    ``[B, Hkv, 2]`` each (dk, dv): ``scales`` = 2^e per (batch, kv head), ``inverse`` = 2^-e, NaN where q, k, v
    or do hold a non-finite value (a NaN term has no integer: both gradients of that kv head come out NaN).

    e is the largest that keeps every sum below 2^61, from bounds of the true sums (P <= 1 and a softmax
    row sums to 1, so a key's terms over the HR * T query rows of its kv head are bounded by):
    |dV| <= max|dO| * HR * T and |dK| <= sm_scale * max|q| * 2 max||dO|| max||v|| * HR * T (|dP| and
    |delta| each at most max||dO|| max||v||, o being an average of v rows), each doubled for the kernel's own
    rounding; every rounded term adds at most 1/2, and there are far fewer than 2^61 of them. One pass over q,
    v and do on the device, no host sync. A term rounds at 2^-e, which stays below 1e-6 of the largest possible
    sum times the number of terms: far below the bf16 result's own rounding."""
    B, H, T, _ = q.shape
    hkv = v.shape[1]
    rows = (H // hkv) * T

    def per_kv(x):  # [B, H] -> [B, Hkv]: the max over the query heads sharing each kv head
        return x.float().view(B, hkv, H // hkv).amax(-1)

    q_max = per_kv(q.abs().amax((2, 3)))
    do_max = per_kv(do.abs().amax((2, 3)))
    do_norm = per_kv(torch.linalg.vector_norm(do, dim=-1).amax(-1))
    v_norm = torch.linalg.vector_norm(v, dim=-1).amax(-1).float()
    bound = torch.stack((4.0 * sm_scale * q_max * do_norm * v_norm * rows, 2.0 * do_max * rows), -1)
    k_max = k.abs().amax((2, 3)).float()
    finite = (torch.isfinite(bound).all(-1) & torch.isfinite(k_max))[..., None].expand_as(bound)
    e = (61.0 - torch.log2(bound.clamp(min=1e-30))).floor().clamp(-120, 120)
    e = torch.where(finite, e, torch.zeros_like(e))
    return torch.exp2(e).contiguous(), torch.where(finite, torch.exp2(-e), torch.full_like(e, float("nan")))


def sparse_bwd_q(do, q, k, v, o, lse, kv_indices, kv_counts, G: int, BS: int, scale: float, atomic_kv: int,
                 cfg_q: Optional[Config] = None, fx_scale: Optional[torch.Tensor] = None, pack: Optional[int] = None):
    """The split backward's first kernel alone (the tuning sweep also times it alone): ``(dq,
    delta [B, H, T] fp32, dk32, dv32)``; dk32/dv32 are the fp32 atomic dk/dv with ``atomic_kv`` 1 (or True),
    their int64 fixed point with 2 (``fx_scale`` from :func:`fixed_point_scales`), else placeholders the kernel
    never touches. ``do`` must be contiguous. ``pack``: token lists packed ``pack`` groups at a time
    (:mod:`.packing`; None or 1: as given; ``cfg_q`` is then the packed group's), built and consumed a few
    (batch, head) rows at a time so that the packed lists take at most :data:`.packing.PACKED_LISTS_BYTES`."""
    B, H, T, D = q.shape
    TK = k.shape[2]
    P = _pack_factor(pack, G, BS)
    delta = torch.empty(B, H, T, device=q.device, dtype=torch.float32)  # written by bwd_q_kernel
    cfg_q = cfg_q or pick_config("bwd_q", D, P * G, BS)
    dq = torch.empty_like(q)
    atomic_kv = int(atomic_kv)
    if atomic_kv == 2 and fx_scale is None:
        raise ValueError("sparse_bwd_q: atomic_kv=2 (fixed point) needs fx_scale from fixed_point_scales")
    if atomic_kv:
        acc = torch.int64 if atomic_kv == 2 else torch.float32
        dk32 = torch.zeros(k.shape, device=k.device, dtype=acc)
        dv32 = torch.zeros(k.shape, device=k.device, dtype=acc)
    else:
        dk32 = dv32 = dq  # unused by the kernel when ATOMIC_KV is off

    def run(idx, bits, counts, bh0: int, rows: int, Gk: int, GB: int):
        NG = idx.shape[-2]
        bwd_q_kernel[(NG * (Gk // cfg_q["BM"]), rows)](
            q, k, v, o, do, lse, delta, dq, dk32, dv32, idx, idx if bits is None else bits, counts,
            dq if fx_scale is None else fx_scale, T, TK, NG, idx.shape[-1], bh0, scale * LOG2E, scale,
            H=H, HR=H // k.shape[1], K=D, BD=_bd(D), G=Gk, BS=BS,
            BM=cfg_q["BM"], BN=cfg_q["BN"], EVEN_T=_even_keys(TK, BS), ATOMIC_KV=atomic_kv, GB=GB,
            **_launch_opts(cfg_q))

    NG = kv_indices.shape[2]
    if P == 1:
        run(kv_indices, None, _kernel_counts(kv_counts, NG), 0, B * H, G, 0)
        return dq, delta, dk32, dv32
    lists = kv_indices.reshape(1, B * H, NG, kv_indices.shape[3])
    counts = group_counts(kv_counts, NG).reshape(1, B * H, NG)
    for bh0, bh1 in packed_row_chunks(B * H, NG, P, kv_indices.shape[3], TK):
        idx, bits, cnt = pack_token_lists(lists[:, bh0:bh1], counts[:, bh0:bh1], G, P, TK)
        run(idx, bits, cnt, bh0, bh1 - bh0, P * G, G)
        del idx, bits, cnt  # the next chunk's packed lists reuse this memory
    return dq, delta, dk32, dv32


def _sparse_bwd_fused(do, q, k, v, o, lse, kv_indices, kv_counts, G: int, BS: int, scale: float,
                      cfg: Optional[Config] = None):
    """Block lists, 5 matmuls: delta pre-pass, one inverse-map kernel that adds
    dq with fp32 atomics, then dq32 -> q's dtype (softmax scale already applied)."""
    B, H, T, D = q.shape
    TK = k.shape[2]
    hkv = k.shape[1]
    cfg = cfg or pick_config("bwd_fused", D, G, BS)
    dqm = int(cfg.get("DQ", 1))
    if dqm == 2 and (_bd(D) != D or not q.is_cuda):  # TMA needs the exact row width and a GPU
        dqm = 1
    delta = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    o = o.contiguous()  # o only feeds delta: drop its contiguous copy (if any) right after
    bwd_delta_kernel[(triton.cdiv(T, 64), B * H)](o, do, delta, T, K=D, BD=_bd(D), BM=64, num_warps=4)
    del o
    dq32 = torch.zeros(B, H, T, D, device=q.device, dtype=torch.float32)
    dq_arg = dq32
    if dqm == 2:
        from triton.tools.tensor_descriptor import TensorDescriptor

        dq_arg = TensorDescriptor(dq32.view(B * H, T, D), shape=[B * H, T, D], strides=[T * D, D, 1],
                                  block_shape=[1, cfg["BM"], D])
    nkb = math.ceil(TK / BS)
    inv_ptr, inv_grp = build_inverse_map(kv_indices, kv_counts, nkb)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    bwd_kv_kernel[(nkb * (BS // cfg["BN"]), B * hkv)](
        q, k, v, do, lse, delta, dk, dv, dq_arg, inv_ptr, inv_grp, inv_grp, T, TK, nkb, scale * LOG2E, scale,
        H=H, HR=H // hkv, K=D, BD=_bd(D), G=G, BS=BS, BM=cfg["BM"], BN=cfg["BN"], DQ=dqm,
        **_launch_opts(cfg))
    return dq32.to(q.dtype), dk, dv
