"""dsv_prefetch_step_end: the step end's device work and host copy issued before the optimizer step give the
same step end, bit for bit, as dsv_on_step_end alone (a Megatron-Core block, gloo world size 1, CPU); misuse is
refused with an error that says what to do."""

import pytest
import torch

from megatron_dsv.attention import dsv_layers, dsv_on_step_end, dsv_prefetch_step_end, dsv_stage

from .conftest import dsv_config
from .test_block import _block


def _train(fast_table, prefetch: bool, steps: int = 5, device: str = "cpu"):
    cfg = dsv_config(stage_switch_rule="steps", stage_switch_steps=2, sparsity_threshold=0.0,
                     speedup_table=fast_table, granularity="block", kv_block_size=64)
    block = _block(cfg).to(device)
    opt = torch.optim.SGD(block.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    stages = []
    for it in range(steps):
        x = torch.randn(256, 2, 128, generator=gen).to(device)
        block(hidden_states=x, attention_mask=None).square().mean().backward()
        if prefetch:
            dsv_prefetch_step_end(block)
        opt.step()
        opt.zero_grad()
        stages.append(dsv_on_step_end(block, it + 1))
    return block, stages


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prefetched_step_end_is_the_same_step_end(megatron_cpu, fast_table, device):
    """On a GPU the prefetch's copy goes to pinned memory behind an event, read at the step end."""
    plain, plain_stages = _train(fast_table, prefetch=False, device=device)
    early, early_stages = _train(fast_table, prefetch=True, device=device)
    assert plain_stages == early_stages and plain_stages[-1] == 2  # the switch at the same step
    a, b = plain.state_dict(), early.state_dict()
    assert a.keys() == b.keys()
    tensors = [n for n in a if isinstance(a[n], torch.Tensor)]
    assert any("sparsity" in n for n in tensors) and any("predictor" in n for n in tensors)
    # CPU: bit for bit; a GPU's sparse backward adds with atomics, so two runs differ in the last bits either way
    same = torch.equal if device == "cpu" else (lambda x, y: torch.allclose(x.float(), y.float(), rtol=1e-4,
                                                                             atol=1e-6))
    for name in tensors:  # weights, DSV state (sparsity, budgets, recall, counters) and predictors
        assert same(a[name], b[name]), name
    for la, lb in zip(dsv_layers(plain), dsv_layers(early)):
        assert same(la.predictor.wq, lb.predictor.wq) and same(la.predictor.wk, lb.predictor.wk)
        assert (la.stage_host, la.step_host) == (lb.stage_host, lb.step_host)


def test_prefetch_misuse_is_refused(megatron_cpu, fast_table):
    block, _ = _train(fast_table, prefetch=True, steps=1)
    x = torch.randn(256, 2, 128)
    block(hidden_states=x, attention_mask=None).square().mean().backward()
    layers = dsv_layers(block)
    assert all(layer.predictor._stash for layer in layers)  # stage 1: the forwards collected statistics
    dsv_prefetch_step_end(block)
    assert not any(layer.predictor._stash for layer in layers)  # trained now, before the optimizer step
    with pytest.raises(RuntimeError, match="called twice before dsv_on_step_end"):
        dsv_prefetch_step_end(block)
    with pytest.raises(ValueError, match="dp_group differs"):
        dsv_on_step_end(block, 2, dp_group=object())
    with pytest.raises(ValueError, match="empty list of chunks"):
        dsv_prefetch_step_end([])
    assert dsv_on_step_end([], 2) == 1  # a rank without chunks still closes its step
    assert dsv_stage(block) in (1, 2)
