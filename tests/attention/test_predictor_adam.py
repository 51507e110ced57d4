"""The predictors' private Adam: the multi-tensor step over many layers equals textbook Adam per layer."""

import torch

from megatron_dsv.attention.predictor import _ADAM_BETAS, _ADAM_EPS, LowRankPredictor, adam_step_many
from megatron_dsv.config import DSVConfig


def _reference_adam(state, grad, lr, t):
    b1, b2 = _ADAM_BETAS
    m = b1 * state["m"] + (1 - b1) * grad
    v = b2 * state["v"] + (1 - b2) * grad * grad
    p = state["p"] - lr / (1 - b1 ** t) * m / ((v / (1 - b2 ** t)).sqrt() + _ADAM_EPS)
    return dict(p=p, m=m, v=v)


def test_many_layers_equal_textbook_adam_and_skip_idle_layers():
    torch.manual_seed(0)
    preds = [LowRankPredictor(DSVConfig(predictor_input=mode), 4, 32, 64, n)
             for n, mode in enumerate(["qk", "hidden", "qk"], start=1)]
    ref = [{name: dict(p=p.detach().clone(), m=torch.zeros_like(p), v=torch.zeros_like(p))
            for name, p in pr._weights()} for pr in preds]
    lrs, t = [1e-2, 3e-3, 5e-2], [0, 0, 0]
    for step in range(3):
        counts = [2.0, 1.0, 0.0 if step == 1 else 3.0]  # layer 3 has no gradient at step 1
        for i, pr in enumerate(preds):
            if counts[i] == 0:
                continue
            t[i] += 1
            for name, _ in pr._weights():
                g = torch.randn_like(getattr(pr, f"{name}_grad"))
                getattr(pr, f"{name}_grad").copy_(g)
                ref[i][name] = _reference_adam(ref[i][name], g / counts[i], lrs[i], t[i])
            pr.grad_count.fill_(counts[i])
        adam_step_many(preds, lrs, [counts[0], None, counts[2]])  # None: read the buffer
    for i, pr in enumerate(preds):
        assert float(pr.adam_steps[0]) == t[i] and float(pr.grad_count[0]) == 0
        for name, p in pr._weights():
            torch.testing.assert_close(p, ref[i][name]["p"], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(getattr(pr, f"{name}_exp_avg_sq"), ref[i][name]["v"], rtol=1e-6, atol=1e-9)
            assert not bool(getattr(pr, f"{name}_grad").any())
