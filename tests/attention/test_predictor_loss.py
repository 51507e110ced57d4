"""The predictor's Gram-matrix loss equals the explicit score-row loss, in value and gradient."""

import pytest
import torch

from megatron_dsv.attention import predictor as pred_mod
from megatron_dsv.attention.predictor import LowRankPredictor, predictor_loss
from megatron_dsv.config import DSVConfig


def _explicit_grads(p, q, k, hidden, idx, scale):
    """Loss through the rows x S low-rank scores (the definition), and its weight gradients."""
    leaves = {n: w.detach().clone().requires_grad_(True) for n, w in p._weights()}
    B, H, S, _ = q.shape
    q_rows = q.index_select(2, idx).float()
    k_full = k.float().repeat_interleave(H // k.shape[1], dim=1)
    true = torch.matmul(q_rows, k_full.transpose(-1, -2)) * scale
    if p.mode == "qk":
        q_lr, k_lr = p.project(q_rows, k, None, leaves)
    else:
        q_lr = p.project(q, k, hidden.index_select(0, idx), leaves)[0]
        k_lr = p.project(q, k, hidden, leaves)[1]
    lr = torch.matmul(q_lr, k_lr.transpose(-1, -2))
    loss = predictor_loss(lr, true, p.cfg.predictor_loss_cos_weight,
                          p.cfg.predictor_loss_mse_weight).sum() / (B * H * idx.numel())
    return loss, torch.autograd.grad(loss, list(leaves.values()))


@pytest.mark.parametrize("mode", ["qk", "hidden"])
@pytest.mark.parametrize("hkv", [4, 2], ids=["MHA", "GQA"])
@pytest.mark.parametrize("chunk_elems", [1 << 24, 700], ids=["one-block", "chunked"])
def test_fast_loss_matches_explicit(monkeypatch, mode, hkv, chunk_elems):
    monkeypatch.setattr(pred_mod, "_CHUNK_ELEMS", chunk_elems)
    torch.manual_seed(0)
    B, H, S, D, hidden_size = 2, 4, 77, 32, 48
    p = LowRankPredictor(DSVConfig(predictor_input=mode, predictor_rank=8), H, D, hidden_size, layer_number=3)
    with torch.no_grad():  # break the q/k weight symmetry of the 'qk' initialisation
        for _, w in p._weights():
            w.add_(0.3 * torch.randn_like(w))
    q, k = torch.randn(B, H, S, D), torch.randn(B, hkv, S, D)
    hidden = torch.randn(S, B, hidden_size)
    idx = torch.tensor([0, 5, 13, 40, 76])
    ref_loss, ref_grads = _explicit_grads(p, q, k, hidden, idx, D ** -0.5)
    loss = p.accumulate_grad(q, k, hidden, idx, D ** -0.5)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, _), g in zip(p._weights(), ref_grads):
        torch.testing.assert_close(getattr(p, f"{name}_grad"), g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["qk", "hidden"])
@pytest.mark.parametrize("hkv", [4, 1], ids=["MHA", "GQA"])
@pytest.mark.parametrize("chunk_elems", [1 << 24, 700], ids=["one-block", "chunked"])
def test_bf16_inputs_match_fp32_definition(monkeypatch, mode, hkv, chunk_elems):
    """bf16 q/k: the true scores come from a bf16 matmul (no fp32 key copy); only that rounding
    separates the result from the fp32 definition on the same (bf16-valued) inputs."""
    monkeypatch.setattr(pred_mod, "_CHUNK_ELEMS", chunk_elems)
    torch.manual_seed(1)
    B, H, S, D, hidden_size = 2, 4, 93, 64, 48
    p = LowRankPredictor(DSVConfig(predictor_input=mode, predictor_rank=16), H, D, hidden_size, layer_number=2)
    with torch.no_grad():
        for _, w in p._weights():
            w.add_(0.3 * torch.randn_like(w))
    q, k = torch.randn(B, H, S, D).bfloat16(), torch.randn(B, hkv, S, D).bfloat16()
    hidden = torch.randn(S, B, hidden_size).bfloat16()
    idx = torch.tensor([1, 7, 30, 64, 92])
    ref_loss, ref_grads = _explicit_grads(p, q, k, hidden, idx, D ** -0.5)
    loss = p.accumulate_grad(q, k, hidden, idx, D ** -0.5)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=2e-4, atol=1e-6)  # measured 1.4e-5
    for (name, _), g in zip(p._weights(), ref_grads):
        err = (getattr(p, f"{name}_grad") - g).norm() / g.norm()
        assert err < 5e-3, (name, float(err))  # measured 1.1e-3
