"""The 'recall' budget rule in the layer, predictor_train_interval, and the step end's host syncs."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dsv.attention import _ops, dsv_metrics, dsv_on_step_end
from megatron_dsv.attention.dispatcher import SpeedupTable, choose_sparse_density, density_budgets, plan_layer
from megatron_dsv.attention.schedule import sampled_queries, trains_predictor
from megatron_dsv.config import DSVConfig

from .conftest import as_megatron, force_state, planted


def test_density_budgets_and_dispatch(fast_table):
    cfg = DSVConfig(granularity="block", kv_block_size=64, k_min=64, sparsity_threshold=0.8, budget_rule="recall",
                    max_density=None)
    S = 1024  # 16 blocks
    b, tok = density_budgets(torch.tensor([0.05, 0.2, 0.001, 1.0]), S, cfg)
    assert b.tolist() == [1, 4, 1, 16] and tok.tolist() == [64, 256, 64, 1024]  # ceil to blocks, k_min floor
    table = SpeedupTable.from_config(DSVConfig(granularity="block", speedup_table=fast_table), 128)
    # sparse iff 1 - mean(K_h)/S >= threshold: 256 + 256 of 1024 -> 0.75 effective; 64 + 256 -> 0.84375
    assert not choose_sparse_density(torch.tensor([0.2, 0.2]), S, cfg, table)
    assert choose_sparse_density(torch.tensor([0.05, 0.2]), S, cfg, table)
    # the smoothed sparsity plays no part under the recall rule, and vice versa
    sparse, budgets, _ = plan_layer(torch.tensor([0.99, 0.99]), torch.tensor([0.3, 0.3]), S, cfg, table)
    assert not sparse and budgets.tolist() == [5, 5]
    rule_s = DSVConfig(granularity="block", kv_block_size=64, k_min=64, budget_rule="sparsity", max_density=None)
    sparse, budgets, _ = plan_layer(torch.tensor([0.99, 0.99]), torch.tensor([0.3, 0.3]), S, rule_s, table)
    assert sparse and budgets.tolist() == [1, 1]
    slow = SpeedupTable([dict(S=S, sparsity=s, granularity="block", speedup_fwd=0.5, speedup_bwd=0.5)
                         for s in (0.5, 0.99)], granularity="block")
    assert not choose_sparse_density(torch.tensor([0.01, 0.01]), S, cfg, slow)


def test_layer_dispatches_on_budget_density(make_layer, fast_table):
    # token lists, k_min 16, S 512; uncapped (the cap would bound the 30% budget below)
    layer = make_layer(budget_rule="recall", max_density=None, sparsity_threshold=0.8, speedup_table=fast_table)
    force_state(layer, stage=2, sparsity=0.95, density=0.3)  # very sparse, but the recall budget is 30%
    sparse, budgets, tokens = layer.decide(512)
    assert not sparse and budgets.tolist() == [154, 154] and tokens.tolist() == [512, 512]
    force_state(layer, density=[0.1, 0.15])
    sparse, budgets, tokens = layer.decide(512)
    assert sparse and budgets.tolist() == [52, 77] and tokens.tolist() == [52, 77]


def _profile_once(layer, seed=0, nuisance=10.0):
    q, k = planted(seed=seed, nuisance=nuisance)
    layer.train()
    layer(as_megatron(q), as_megatron(k), as_megatron(torch.randn_like(k)), None)
    dsv_on_step_end(layer, int(layer.step_host) + 1)
    return q, k


@pytest.mark.parametrize("granularity", ["token", "block"])
def test_first_profile_budget_reaches_target(make_layer, granularity):
    """The measured budget density builds lists that reach recall_target on the profiled queries (the
    logged recall is the oracle's, on the lists actually built); at block granularity a budget of one
    block fewer would miss it."""
    layer = make_layer(budget_rule="recall", max_density=None, granularity=granularity, kv_block_size=64,
                       recall_target=0.9, k_min=1)
    layer.predictor_training = False  # the reference lists below need the weights the profiler saw
    q, k = _profile_once(layer)
    m = dsv_metrics(layer)
    assert m["dsv/layer1/recall"] >= 0.9 - 1e-5, m
    dens = layer.budget_density.clone()
    assert dens.min() < 1.0 and m["dsv/layer1/budget_density"] == pytest.approx(float(dens.mean()))
    cfg, unit = layer.dsv_config, layer.dsv_config.block_size or 1
    items = torch.round(dens.double() * 512 / unit).long()
    qidx = sampled_queries(512, cfg.predictor_query_stride, 0, "cpu")
    below = layer._estimate(q, k, None, (items - 1).clamp(min=1))
    missed = _ops.critical_mass_recall(q, k, *below, cfg.group_size, cfg.block_size, cfg.theta, None, qidx).mean(0)
    assert torch.all((missed < 0.9 + 1e-6) | (items == 1)), (items, missed)


def test_budget_density_is_smoothed_and_round_trips(make_layer):
    a = make_layer(budget_rule="recall", max_density=None, sparsity_momentum=0.5)
    measured = iter([torch.tensor([0.2, 0.3]), torch.tensor([0.6, 0.1])])
    a._recall_density = lambda *args: next(measured)  # the profiler's measurement, fixed
    _profile_once(a, seed=0)
    assert torch.allclose(a.budget_density, torch.tensor([0.2, 0.3]))  # the first is taken as is
    _profile_once(a, seed=1)
    second = a.budget_density.clone()
    # head 0 needs more (0.6): taken at once; head 1 needs less (0.1): smoothed, 0.5 * 0.3 + 0.5 * 0.1
    assert torch.allclose(second, torch.tensor([0.6, 0.2]))
    assert torch.equal(a._density_cpu, second) and a.decide(512)[1].tolist() == [308, 103]
    m = dsv_metrics(a)  # the smoothed budget and the last profile's own measurement, side by side
    assert m["dsv/layer1/budget_density"] == pytest.approx(0.4) and m["dsv/budget_density_mean"] == pytest.approx(0.4)
    assert m["dsv/layer1/budget_density_measured"] == pytest.approx(0.35)
    assert m["dsv/budget_density_measured_mean"] == pytest.approx(0.35)
    sd = a.state_dict()
    assert torch.equal(sd["budget_density"], second)
    c = make_layer(layer_number=5)
    c.load_state_dict(sd)
    assert torch.equal(c.budget_density, second) and torch.equal(c._density_cpu, second)
    assert dsv_metrics(c)["dsv/layer5/budget_density_measured"] == pytest.approx(0.4)  # not saved: the budget
    sharded = a.sharded_state_dict(prefix="x.")
    assert torch.equal(sharded["x.budget_density"].data, second)
    # an old checkpoint without budget_density loads, starting from the sparsity rule's 1 - s
    old = {k: v for k, v in sd.items() if k != "budget_density"}
    d = make_layer()
    d.load_state_dict(old)
    assert torch.allclose(d.budget_density, 1.0 - sd["sparsity"])


def test_predictor_train_interval():
    cfg = DSVConfig(predictor_train_interval=3)
    assert [trains_predictor(s, 1, cfg) for s in range(4)] == [True] * 4  # stage 1 always trains
    assert [trains_predictor(s, 2, cfg) for s in range(7)] == [True, False, False, True, False, False, True]
    never = DSVConfig(predictor_train_interval=0)
    assert not any(trains_predictor(s, 2, never) for s in range(10)) and trains_predictor(5, 1, never)


def test_stage2_trains_every_interval(make_layer, fast_table):
    layer = make_layer(predictor_train_interval=2, sparsity_threshold=0.0, speedup_table=fast_table,
                       profile_interval=1000)
    force_state(layer, stage=2, sparsity=0.5)
    steps = []
    for it in range(4):
        before = float(layer.predictor.adam_steps[0])
        _profile_once(layer, seed=it)
        steps.append(float(layer.predictor.adam_steps[0]) - before)
    assert steps == [1.0, 0.0, 1.0, 0.0]  # steps 0 and 2 train
    loss = layer.predictor_loss.clone()
    layer.predictor_training = False  # the benchmarks' A/B switch
    _profile_once(layer, seed=9)
    assert float(layer.predictor.adam_steps[0]) == 2 and torch.equal(layer.predictor_loss, loss)


class _ScalarReads(TorchDispatchMode):
    """Counts scalar reads (item / float / int) of tensors whose storage belongs to the given set."""

    def __init__(self, storages):
        super().__init__()
        self.storages, self.hits = storages, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].untyped_storage().data_ptr() in self.storages:
            self.hits += 1
        return func(*args, **(kwargs or {}))


def test_step_end_reads_the_device_once(make_layer, monkeypatch):
    """Three layers, a profiled and trained step: the step end makes one host copy and never reads
    a scalar of module state (each would be a stream sync on a GPU)."""
    layers = torch.nn.ModuleList([make_layer(layer_number=n) for n in (1, 2, 3)])
    q, k = planted()
    layers.train()
    for layer in layers:
        layer(as_megatron(q), as_megatron(k), as_megatron(torch.randn_like(k)), None)
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **kw: copies.append(1) or real_cpu(self, *a, **kw))
    storages = {t.untyped_storage().data_ptr() for t in list(layers.buffers()) + list(layers.parameters())}
    with _ScalarReads(storages) as reads:
        dsv_on_step_end(layers, 1)
    assert len(copies) == 1 and reads.hits == 0, (len(copies), reads.hits)
    assert all(l.profiled_host and l.step_host == 1 and float(l.predictor.adam_steps[0]) == 1 for l in layers)
    metrics = dsv_metrics(layers)
    assert all(0 < metrics[f"dsv/layer{n}/budget_density"] <= 1 for n in (1, 2, 3))
