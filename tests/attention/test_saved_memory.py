"""Activation memory: what one DSV stage-2 layer saves for backward, against the dense layer.

The issue (benchmarks/results/e2e-h200-20261201.json): the 2.7b video DiT trained in stage 2 peaked
higher than with dense attention, by ~512 B per (token, head) per layer = two extra bf16 copies of a
``[S, H, 128]`` tensor. Both were saved-for-backward duplicates: the sparse kernel's contiguous copy of
v (Megatron's v is a view of the fused QKV output, which the q/k LayerNorms save anyway) and its
``[B, H, S, D]`` output, copied again by the ``[S, B, H*D]`` reshape that ``linear_proj`` saves. Dense
SDPA saves neither (strided v view; output in q's layout). Measured with saved_tensors_hooks on the
whole model's forward (storages counted once): the layers differ only in their core attention, so
DSV may exceed dense by its lists alone.
"""

import math

import pytest
import torch

from megatron_dsv.config import DSVConfig
from megatron_dsv.models.video_dit import VideoDiTConfig, build_video_dit
from megatron_dsv.ops.sparse_attention import sparse_attention
from tests.attention.conftest import force_state

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU accounting (Triton under its interpreter, SDPA's CPU path)")

HEADS, HEAD_DIM, BATCH = 2, 64, 2


def _saved_bytes(fn):
    """(bytes of the distinct storages saved for backward while ``fn`` runs, its result)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def _layer_saved_bytes(qk_layernorm: bool, dsv: bool):
    # 8 x 16 x 16 latents, patch 2 -> S = 8 * 8 * 8 = 512 tokens: 4 query cubes of 4x4x8, 4 key blocks of 128
    cfg = VideoDiTConfig.from_preset("tiny", hidden=HEADS * HEAD_DIM, heads=HEADS, head_dim=HEAD_DIM, layers=1,
                                     latent_frames=8, latent_height=16, latent_width=16, num_classes=4,
                                     qk_layernorm=qk_layernorm)
    # 1 key block of 4 per head is 75% sparse: a threshold of 0.5 runs it sparse whatever the default
    # (and no neighbourhood: on this 2 x 2 x 1 cube grid the (1, 1, 1) default would keep every key)
    dsv_config = (DSVConfig(kernel_backend="triton", topk_backend="naive", sparsity_threshold=0.5,
                            local_radius=(0, 0, 0)) if dsv else None)
    torch.manual_seed(0)
    model = build_video_dit(cfg, dsv_config=dsv_config, use_te=False)
    model.train()
    layer = model.decoder.layers[0].self_attention.core_attention
    if dsv:  # stage 2 at ~90% sparsity, plain step (no predictor statistics, no profile)
        force_state(layer, stage=2, sparsity=[0.8, 0.98])
        layer.predictor_training = layer.profiling = False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, cfg.in_channels, *cfg.latent_grid, generator=g)
    t, y = torch.rand(BATCH, generator=g), torch.zeros(BATCH, dtype=torch.long)
    nbytes, _ = _saved_bytes(lambda: model(x, t, y))
    if dsv:
        assert layer.last_sparse, "the DSV layer must run sparse for this test to mean anything"
    return nbytes, math.prod(cfg.token_grid()), dsv_config


@pytest.mark.parametrize("qk_layernorm", [True, False], ids=["qk_norm", "no_qk_norm"])
def test_stage2_layer_saves_no_more_than_dense(megatron_cpu, qk_layernorm):
    dense, S, _ = _layer_saved_bytes(qk_layernorm, dsv=False)
    sparse, _, cfg = _layer_saved_bytes(qk_layernorm, dsv=True)
    # allowance: the lists, int32 kv_indices [B, H, S / G, Kmax <= S / block] and kv_counts [B, H]
    lists = 4 * BATCH * HEADS * ((S // cfg.group_size) * (S // cfg.block_size) + 1)
    per = BATCH * S * HEADS  # (token, head) pairs; one fp32 copy of [B, S, H, D] is 4 * 64 = 256 B each
    assert sparse <= dense + lists, (f"DSV stage 2 saves {sparse} B vs dense {dense} B (+ lists {lists} B): "
                                     f"{(sparse - dense) / per:+.1f} B per (token, head)")


def test_output_layout_and_saved_v_view():
    """Megatron's layout in, bitwise the same results as contiguous inputs; o comes back in q's layout
    (its [S, B, H*D] reshape is a view) and v is saved as the view it was passed, not copied."""
    S, B, H, D, G, BS = 256, 2, 2, 64, 64, 64
    gen = torch.Generator().manual_seed(0)
    q_sbhd = torch.randn(S, B, H, D, generator=gen, requires_grad=True)
    kv = torch.randn(S, B, H, 2 * D, generator=gen, requires_grad=True)  # a fused k|v projection
    q = q_sbhd.permute(1, 2, 0, 3)
    k, v = (t.permute(1, 2, 0, 3) for t in kv.split(D, dim=-1))
    nk = S // BS
    idx = torch.stack([torch.randperm(nk, generator=gen)[:3].sort().values for _ in range(B * H * (S // G))])
    idx = idx.view(B, H, S // G, 3).int()
    cnt = torch.tensor([[3, 1], [2, 3]], dtype=torch.int32)
    do = torch.randn(B, H, S, D, generator=gen)
    ref_in = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    ref = sparse_attention(*ref_in, idx, cnt, G, BS, backend="triton")
    ref_grads = torch.autograd.grad(ref, ref_in, do)
    saved, o = _saved_bytes(lambda: sparse_attention(q, k, v, idx, cnt, G, BS, backend="triton"))
    assert o.permute(2, 0, 1, 3).is_contiguous()
    assert torch.equal(o, ref)
    grads = torch.autograd.grad(o, (q, k, v), do)
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)
    # q and k contiguous copies (2 x 4 B x B*H*S*D), v's base kv (2x), o, lse and the lists
    one = 4 * B * H * S * D
    assert saved <= 5 * one + 4 * B * H * S + idx.numel() * 4 + cnt.numel() * 4
