"""The benchmarks' AdamW on fp32 main weights (``benchmarks.common.MainWeightsAdamW``)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import MainWeightsAdamW  # noqa: E402


def _steps(opt, params, grads):
    for grad_list in grads:
        for p, g in zip(params, grad_list):
            p.grad = g.to(p.dtype)
        opt.step()
        opt.zero_grad()


def _grads(n_steps, shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(s, generator=g) + 0.5).bfloat16().float() for s in shapes] for _ in range(n_steps)]


def test_bf16_gain_moves_only_with_main_weights():
    """A norm gain at 1.0, lr 3e-4: bf16 AdamW in place loses every update, the main weights keep them."""
    grads = [[torch.full((8,), -1.0)] for _ in range(40)]  # a steady push upwards
    plain = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    _steps(torch.optim.AdamW([plain], lr=3e-4, weight_decay=0.0), [plain], grads)
    assert torch.equal(plain.detach(), torch.ones(8, dtype=torch.bfloat16))  # the loss this class fixes
    gain = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    _steps(MainWeightsAdamW([gain], lr=3e-4, weight_decay=0.0), [gain], grads)
    assert gain.dtype == torch.bfloat16
    assert float(gain.detach().float().min()) > 1.0  # 40 * 3e-4 = 0.012 > one bf16 step above 1 (2^-7)


def test_main_weights_follow_fp32_adamw_exactly():
    """Same gradients: the fp32 main copies equal an fp32 AdamW's parameters; the model holds their rounding."""
    shapes = [(5, 3), (7,), (1,)]
    init = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    ref = [x.clone().requires_grad_(True) for x in init]
    low = [x.bfloat16().requires_grad_(True) for x in init]
    ref_init = [x.bfloat16().float() for x in init]  # the bf16 model starts from the rounded values
    for r, x in zip(ref, ref_init):
        r.data.copy_(x)
    grads = _grads(6, shapes)
    ref_opt = torch.optim.AdamW([dict(params=ref[:2]), dict(params=ref[2:], lr=1e-2)], lr=1e-3, weight_decay=0.1)
    opt = MainWeightsAdamW([dict(params=low[:2]), dict(params=low[2:], lr=1e-2)], lr=1e-3, weight_decay=0.1)
    _steps(ref_opt, ref, grads)
    _steps(opt, low, grads)
    mains = opt.state_dict()["main_params"]
    for r, m, p in zip(ref, mains, low):
        torch.testing.assert_close(m, r.detach(), rtol=0, atol=0)
        assert torch.equal(p.detach(), r.detach().bfloat16())


def test_fp32_parameters_are_not_copied():
    p = torch.zeros(3, requires_grad=True)
    d = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    opt = MainWeightsAdamW([p, d], lr=0.1)
    assert opt.param_groups[0]["params"][0] is p and opt.param_groups[0]["params"][1] is d
    assert opt.state_dict()["main_params"] == []
    with pytest.raises(ValueError, match="twice"):
        MainWeightsAdamW([dict(params=[p]), dict(params=[p])], lr=0.1)


def test_parameter_without_gradient_is_left_alone():
    """A low-precision parameter changed outside the optimizer (no gradient this step) keeps its value."""
    a = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    b = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    opt = MainWeightsAdamW([a, b], lr=0.1)
    with torch.no_grad():
        b.fill_(5.0)
    a.grad = torch.ones_like(a)
    opt.step()
    assert torch.equal(b.detach(), torch.full((3,), 5.0, dtype=torch.bfloat16))
    assert float(a.detach()[0]) < 1.0


def test_group_keys_survive_for_the_schedule():
    p = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    opt = MainWeightsAdamW([dict(params=[p], lr_mult=10.0)], lr=1e-3)
    assert opt.param_groups[0]["lr_mult"] == 10.0


def test_resume_continues_exactly_and_rejects_a_plain_state():
    shapes = [(4, 4), (4,)]
    grads = _grads(8, shapes, seed=3)

    def fresh():
        params = [torch.randn(s, generator=torch.Generator().manual_seed(7 + i)).bfloat16().requires_grad_(True)
                  for i, s in enumerate(shapes)]
        return params, MainWeightsAdamW(params, lr=5e-3)

    straight, opt = fresh()
    _steps(opt, straight, grads)
    first, opt1 = fresh()
    _steps(opt1, first, grads[:4])
    state = opt1.state_dict()
    resumed, opt2 = fresh()  # the model as saved holds only bf16 values; the state restores the fp32 ones
    with torch.no_grad():
        for r, f in zip(resumed, first):
            r.copy_(f)
    opt2.load_state_dict(state)
    _steps(opt2, resumed, grads[4:])
    for a, b in zip(straight, resumed):
        assert torch.equal(a.detach(), b.detach())
    plain_state = torch.optim.AdamW(resumed, lr=5e-3).state_dict()
    with pytest.raises(ValueError, match="main_params"):
        opt2.load_state_dict(plain_state)
    with pytest.raises(ValueError, match="main weights"):
        opt2.load_state_dict(dict(state, main_params=state["main_params"][:1]))
