"""The Triton top-k's scoring, shared by its kernels (``triton_impl``'s search and sample kernels,
``keys_impl``'s ``_tk_keys``): the ordered int32 key of every (query group, item) pair, an item being a key
token or a block of ``BS`` of them (its max or log-sum-exp), the score the proxy's dot product with the key
as ``naive.py`` defines it. A key orders as its float does (-0.0 read as +0.0), so the kernels search and
compare int32 keys.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _item_scores(Pb, Kb, offs_g, mask_g, it0, S, n_items,
                 R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr,
                 DOT: tl.constexpr = False):
    items = it0 + tl.arange(0, BN)
    valid = items < n_items
    key = _scores_at(Pb, Kb, offs_g, mask_g, items, valid, S, R, BG, BN, BS, LSE, DOT)
    return key, items, valid


@triton.jit
def _scores_at(Pb, Kb, offs_g, mask_g, items, valid, S,
               R: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, LSE: tl.constexpr,
               DOT: tl.constexpr = False):
    """Ordered int32 keys [BG, BN] of the items ``items`` [BN] (any order, ``valid`` masks loads).
    DOT (R a power of two >= 16): the [BG, R] x [R, BN] product (block items: [BG, R] x [R, BN * BS], the items'
    tokens side by side, then each block's max or log-sum-exp) as one ``tl.dot`` on tiles loaded whole, instead
    of R dependent column loads. 1: in fp32 with IEEE precision (FMA units); 2: in the inputs' own fp16/bf16 on
    tensor cores with fp32 accumulation, as the CUDA kernel scores (exact products; the sum's rounding is the
    MMA's, so lists equal the column loop's up to near-exact ties). Both are exact on integer-valued inputs, and
    their summation order is the compiler's."""
    if DOT:
        # one product over the tile's tokens: [BG, R] x [R, BN] (token items) or [R, BN * BS] (block items, their
        # tokens side by side, then [BG, BN, BS])
        rr = tl.arange(0, R)
        if BS == 0:
            toks, tval = items, valid
        else:
            toks = tl.reshape(items[:, None] * BS + tl.arange(0, BS)[None, :], (BN * BS,))
            tval = toks < S
        pt = tl.load(Pb + offs_g[:, None] * R + rr[None, :], mask=mask_g[:, None], other=0.0)
        kt = tl.load(Kb + toks[None, :] * R + rr[:, None], mask=tval[None, :], other=0.0)
        if DOT == 2:
            s = tl.dot(pt, kt, out_dtype=tl.float32)
        else:
            s = tl.dot(pt.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        if BS > 0:
            s3 = tl.reshape(tl.where(tval[None, :], s, float("-inf")), (BG, BN, BS))
    elif BS == 0:
        # [BG, BN]; sums in order d = 0..R-1 as the reference, with explicit fma: exact for
        # bf16/fp16 (products are exact), and the same instructions in both kernels for fp32
        # (left to itself the compiler may fuse mul+add differently in the two kernels)
        p0 = tl.load(Pb + offs_g * R, mask=mask_g, other=0.0).to(tl.float32)
        k0 = tl.load(Kb + items * R, mask=valid, other=0.0).to(tl.float32)
        s = p0[:, None] * k0[None, :]
        for d in range(1, R):  # a loop, not unrolled: one column of keys live at a time
            pd = tl.load(Pb + offs_g * R + d, mask=mask_g, other=0.0).to(tl.float32)
            kd = tl.load(Kb + items * R + d, mask=valid, other=0.0).to(tl.float32)
            s = tl.fma(tl.broadcast_to(pd[:, None], (BG, BN)), tl.broadcast_to(kd[None, :], (BG, BN)), s)
    else:
        toks = items[:, None] * BS + tl.arange(0, BS)[None, :]  # [BN, BS]
        tval = toks < S
        p0 = tl.load(Pb + offs_g * R, mask=mask_g, other=0.0).to(tl.float32)
        k0 = tl.load(Kb + toks * R, mask=tval, other=0.0).to(tl.float32)
        s3 = p0[:, None, None] * k0[None, :, :]  # [BG, BN, BS]
        for d in range(1, R):  # a loop, not unrolled (as above)
            pd = tl.load(Pb + offs_g * R + d, mask=mask_g, other=0.0).to(tl.float32)
            kd = tl.load(Kb + toks * R + d, mask=tval, other=0.0).to(tl.float32)
            s3 = tl.fma(tl.broadcast_to(pd[:, None, None], (BG, BN, BS)),
                        tl.broadcast_to(kd[None, :, :], (BG, BN, BS)), s3)
        s3 = tl.where(tval[None, :, :], s3, float("-inf"))
    if BS > 0:  # [BG, BN, BS] token scores (padding -inf) -> each block's max or log-sum-exp
        m = tl.max(s3, axis=2)
        if LSE:
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            s = m_safe + tl.log(tl.sum(tl.exp(s3 - m_safe[:, :, None]), axis=2))
        else:
            s = m
    s = s + 0.0  # -0.0 -> +0.0
    key = s.to(tl.int32, bitcast=True)
    key = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)  # monotone int32 key of the float
    return key
