"""The predictor's second-moment loss and closed-form gradients equal the explicit score-row loss
and its autograd gradients."""

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


@pytest.mark.parametrize("hkv", [6, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("zero_row", [False, True])
def test_closed_form_equals_autograd_fp64(hkv, zero_row):
    """The closed form (second moments + hand-written backward) against autograd through the
    explicit rows x S definition, in float64, for both inputs' shapes: q-side features of width
    Fq, key-side features of width F (F = D for 'qk'), GQA, and a query row of zeros (cosine 0, as
    F.normalize's eps gives)."""
    torch.manual_seed(hkv)
    B, H, S, D, F, Fq, r, n = 2, 6, 53, 8, 12, 10, 4, 7
    dt = torch.float64
    q_rows, k = torch.randn(B, H, n, D, dtype=dt), torch.randn(B, hkv, S, D, dtype=dt)
    if zero_row:
        q_rows[1, 2, 3] = 0.0
    x, xq = torch.randn(B, S, F, dtype=dt), torch.randn(B, H, n, Fq, dtype=dt)
    wq = torch.randn(H, Fq, r, dtype=dt, requires_grad=True)
    wk = torch.randn(H, F, r, dtype=dt, requires_grad=True)
    weight = 0.9 + 2 * 0.1 / S
    k_h = k.repeat_interleave(H // hkv, dim=1)
    true = torch.matmul(q_rows, k_h.transpose(-1, -2))  # [B, H, n, S]
    lr = torch.matmul(torch.matmul(xq, wq), torch.matmul(x.unsqueeze(1), wk).transpose(-1, -2))
    ref = predictor_loss(lr, true, 0.9, 0.1).sum() / (B * H * n)
    ref_grads = torch.autograd.grad(ref, [wq, wk])
    gk = torch.matmul(k.transpose(-1, -2), k)
    c = torch.matmul(x.transpose(-1, -2).unsqueeze(1), k)  # [B, Hkv, F, D]
    gx = torch.matmul(x.transpose(-1, -2), x).unsqueeze(1)
    loss, d_wq, d_wk = pred_mod._cosine_loss_and_grads(xq, q_rows, wq.detach(), wk.detach(), gk, gx, c, weight)
    # a zero true row is not a unit row: its MSE is 1/S, not 2 (1 - cos) / S (loss only; no gradient)
    expect = ref.detach() + (0.1 / S / (B * H * n) if zero_row else 0.0)
    torch.testing.assert_close(loss, expect, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(d_wq, ref_grads[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(d_wk, ref_grads[1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", ["qk", "hidden"])
@pytest.mark.parametrize("hkv", [4, 2], ids=["MHA", "GQA"])
def test_fast_loss_matches_explicit(mode, hkv):
    """The module's call (fp32) against the explicit definition, and gradients add up over calls."""
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
    for _ in range(2):
        loss = p.accumulate_grad(q, k, hidden, idx, D ** -0.5)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, _), g in zip(p._weights(), ref_grads):
        torch.testing.assert_close(getattr(p, f"{name}_grad"), 2 * g, rtol=1e-4, atol=1e-6, msg=name)
    assert float(p.grad_count[0]) == 2


@pytest.mark.parametrize("mode", ["qk", "hidden"])
@pytest.mark.parametrize("hkv", [4, 1], ids=["MHA", "GQA"])
def test_bf16_inputs_match_fp32_definition(mode, hkv):
    """bf16 q/k/hidden: the second moments are taken from the bf16 values with fp32 accumulation;
    the result matches the fp32 definition on the same (bf16-valued) inputs."""
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
    p.collect(q, k, hidden, idx)  # the stash keeps the sampled rows in bf16 (upcast, exactly, at the step end)
    (st,) = p._stash
    assert st.q_rows.dtype == st.xq.dtype == torch.bfloat16 and torch.equal(st.q_rows, q[:, :, idx])
    p._stash = []
    loss = p.accumulate_grad(q, k, hidden, idx, D ** -0.5)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=2e-4, atol=1e-6)  # measured 1.4e-5
    for (name, _), g in zip(p._weights(), ref_grads):
        err = (getattr(p, f"{name}_grad") - g).norm() / g.norm()
        assert err < 5e-3, (name, float(err))  # measured 1.1e-3


@pytest.mark.parametrize("mode", ["qk", "hidden"])
def test_batched_training_equals_one_call_at_a_time(monkeypatch, mode):
    """train_predictors over layers x micro-batches (two sequence lengths, so two shape groups)
    gives each predictor the gradients and loss sum of its calls trained one by one; a predictor
    whose stash fills up trains early and loses nothing; no foreach launch sees a buffer twice."""
    torch.manual_seed(4)
    H, D, F = 4, 16, 24
    cfg = DSVConfig(predictor_input=mode, predictor_rank=8)
    preds = [LowRankPredictor(cfg, H, D, F, layer_number=n) for n in (1, 2, 3)]
    refs = [LowRankPredictor(cfg, H, D, F, layer_number=n) for n in (1, 2, 3)]
    calls = []
    for S in (50, 50, 64, 64):
        q, k, hidden = torch.randn(2, H, S, D), torch.randn(2, 2, S, D), torch.randn(S, 2, F)
        calls.append((q, k, hidden, torch.arange(3, S, 9)))
    real_add = torch._foreach_add_

    def one_launch_per_buffer(tensors, others):  # CUDA's fused add would race on a repeated buffer
        assert len({id(t) for t in tensors}) == len(tensors), "a gradient buffer twice in one foreach"
        return real_add(tensors, others)

    monkeypatch.setattr(torch, "_foreach_add_", one_launch_per_buffer)
    monkeypatch.setattr(pred_mod, "_MAX_STASH", 3)  # predictor 3 trains early at its third call
    expect = []
    for i, (p, ref) in enumerate(zip(preds, refs)):
        mine = calls if i == 2 else calls[:2]  # predictors 1, 2: two micro-batches of one shape
        for q, k, hidden, idx in mine:
            p.collect(q, k, hidden, idx)
        expect.append(sum(float(ref.accumulate_grad(q, k, hidden, idx)) for q, k, hidden, idx in mine))
    assert len(preds[2]._stash) == 1 and preds[2]._trained_early[1] == 3
    sums, counts = pred_mod.train_predictors(preds)
    assert counts == [2, 2, 4] and all(not p._stash for p in preds)
    torch.testing.assert_close(sums, torch.tensor(expect), rtol=1e-5, atol=1e-6)
    for p, ref in zip(preds, refs):
        for b, r in zip(p.grad_buffers(), ref.grad_buffers()):
            torch.testing.assert_close(b, r, rtol=1e-4, atol=1e-7)
        assert float(p.grad_count[0]) == float(ref.grad_count[0])
    assert pred_mod.train_predictors(preds)[1] == [0, 0, 0]  # nothing left
