"""Dispatcher decisions and budgets on synthetic sparsity; schedule rules; bad configs."""

import json
import math

import pytest
import torch

from megatron_dsv.attention.dispatcher import SpeedupTable, choose_sparse, density_budgets, head_budgets, plan_layer
from megatron_dsv.attention.schedule import (is_profile_step, profile_thinning, sampled_queries, should_switch,
                                             smooth)
from megatron_dsv.config import DSVConfig


def test_budgets_token_granularity():
    cfg = DSVConfig(granularity="token", k_min=64, max_density=None)
    b, tok = head_budgets(torch.tensor([0.9, 0.99, 0.0, 0.5]), 1000, cfg)
    assert b.tolist() == [100, 64, 1000, 500]  # ceil((1-s)*S), floor k_min, capped at S
    assert torch.equal(b, tok)


def test_budgets_block_granularity_round_up():
    cfg = DSVConfig(granularity="block", kv_block_size=64, k_min=64, max_density=None)
    S = 1000  # 16 blocks, the last one partial
    b, tok = head_budgets(torch.tensor([0.9, 0.999, 0.0]), S, cfg)
    assert b.tolist() == [2, 1, 16]  # 100 tokens -> 2 blocks; k_min 64 -> 1 block; all -> 16
    assert tok.tolist() == [128, 64, 1000]


def test_dispatcher_on_synthetic_sparsity(fast_table):
    cfg = DSVConfig(granularity="token", sparsity_threshold=0.8, k_min=16)
    flop = SpeedupTable.from_config(cfg, head_dim=128)
    assert flop.source == "flop_model"
    S = 4096
    assert choose_sparse(torch.tensor([0.95, 0.9]), S, cfg, flop)
    assert not choose_sparse(torch.tensor([0.75, 0.8]), S, cfg, flop)  # mean below threshold
    # measured table: 2x everywhere -> sparse above the threshold only
    measured = SpeedupTable.from_config(DSVConfig(granularity="token", speedup_table=fast_table), 128)
    assert measured.source == "measured"
    assert choose_sparse(torch.tensor([0.85, 0.85]), S, cfg, measured)
    # a table that says sparse is slower keeps a very sparse layer dense
    slow = SpeedupTable([dict(S=S, sparsity=s, granularity="token", speedup_fwd=0.5, speedup_bwd=0.5)
                         for s in (0.5, 0.99)], granularity="token")
    assert not choose_sparse(torch.tensor([0.97, 0.97]), S, cfg, slow)


def test_max_density_caps_budgets_above_the_floor_and_decides_on_them():
    """The cap bounds each head's list at max_density * S (block-rounded), yields to k_min and the neighbourhood
    floor, and makes a layer sparse on the capped budgets even when its measured sparsity is under the threshold."""
    S = 16384
    cfg = DSVConfig(granularity="block", kv_block_size=128, k_min=64, max_density=0.25, sparsity_threshold=0.7)
    flop = SpeedupTable.from_config(cfg, head_dim=64)
    sparsity = torch.tensor([0.3, 0.5, 0.9, 0.99])
    blocks, tokens = head_budgets(sparsity, S, cfg)
    assert blocks.tolist() == [32, 32, 13, 2]  # 0.25 * 16384 = 32 blocks; (1 - 0.9) S -> 13 blocks below the cap
    blocks, tokens = head_budgets(sparsity, S, cfg, min_tokens=27 * 128)  # the (1, 1, 1) neighbourhood floor
    assert blocks.tolist() == [32, 32, 27, 27]
    assert density_budgets(torch.tensor([0.6, 0.1]), S, cfg)[0].tolist() == [32, 13]  # rule 'recall' too
    # uncapped, a layer measured at mean sparsity 0.4 stays dense; capped, it runs sparse on its capped lists
    uncapped = DSVConfig(granularity="block", kv_block_size=128, sparsity_threshold=0.7, max_density=None)
    low = torch.tensor([0.3, 0.5])
    assert not plan_layer(low, 1 - low, S, uncapped, flop)[0]
    sparse, blocks, tokens = plan_layer(low, 1 - low, S, cfg, flop)
    assert sparse and tokens.tolist() == [4096, 4096]
    # a cap above 1 - threshold leaves the layer dense (its capped budgets are not sparse enough)
    loose = DSVConfig(granularity="block", kv_block_size=128, max_density=0.5, sparsity_threshold=0.7)
    assert not plan_layer(low, 1 - low, S, loose, flop)[0]
    # a floor larger than the cap wins: the neighbourhood always fits, and its density is what decides
    assert not plan_layer(low, 1 - low, S, cfg, flop, min_tokens=S // 2)[0]
    for bad in (0.0, 1.5, True, -0.1):
        with pytest.raises(ValueError, match="max_density"):
            DSVConfig(max_density=bad)


def test_speedup_table_interpolation_and_combination():
    rows = [dict(S=1024, sparsity=0.5, granularity="block", speedup_fwd=1.0, speedup_bwd=1.0),
            dict(S=1024, sparsity=0.9, granularity="block", speedup_fwd=3.0, speedup_bwd=3.0),
            dict(S=65536, sparsity=0.9, granularity="block", speedup_fwd=6.0, speedup_total=5.0),
            dict(S=65536, sparsity=0.9, granularity="token", speedup_fwd=9.0, speedup_bwd=9.0)]
    t = SpeedupTable(rows, granularity="block")
    assert t.speedup(1024, 0.7) == pytest.approx(2.0)
    assert t.speedup(1000, 0.99) == pytest.approx(3.0)  # nearest S, clamped sparsity
    assert t.speedup(60000, 0.9) == pytest.approx(5.0)  # speedup_total wins in training
    assert t.speedup(60000, 0.9, training=False) == pytest.approx(6.0)
    mixed = SpeedupTable([dict(S=1, sparsity=0.9, granularity="block", speedup_fwd=2.0, speedup_bwd=4.0)])
    assert mixed.speedup(1, 0.9) == pytest.approx(3.5 / (1 / 2 + 2.5 / 4))


def test_flop_model_is_monotone():
    t = SpeedupTable(None, granularity="block", head_dim=128, rank=16, group_size=64)
    values = [t.speedup(65536, s) for s in (0.0, 0.5, 0.8, 0.9, 0.95)]
    assert values == sorted(values) and values[0] < 1.0 < values[2]
    assert values[3] == pytest.approx(1 / (0.1 / 0.75 + 16 / (64 * 128 * 7)), rel=1e-6)


def test_bad_speedup_table(tmp_path):
    with pytest.raises(ValueError, match="speedup_table"):
        SpeedupTable.from_config(DSVConfig(speedup_table=str(tmp_path / "missing.json")), 128)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"meta": {}, "rows": [dict(S=1, sparsity=0.9, granularity="token", speedup_fwd=2)]}))
    with pytest.raises(ValueError, match="granularity"):
        SpeedupTable.from_config(DSVConfig(speedup_table=str(path), granularity="block"), 128)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="rows"):
        SpeedupTable.from_config(DSVConfig(speedup_table=str(path)), 128)


@pytest.mark.parametrize("rule,loss,step,expect", [
    ("loss", 0.005, 1, True), ("loss", 0.02, 10**6, False), ("loss", None, 1, False),
    ("steps", 0.0, 9, False), ("steps", 1.0, 10, True),
    ("loss_or_steps", 0.005, 1, True), ("loss_or_steps", 1.0, 10, True), ("loss_or_steps", 1.0, 9, False),
    ("loss_and_steps", 0.005, 9, False), ("loss_and_steps", 1.0, 10, False), ("loss_and_steps", 0.005, 10, True),
])
def test_stage_switch_rules(rule, loss, step, expect):
    cfg = DSVConfig(stage_switch_rule=rule, stage_switch_steps=10, stage_switch_loss=0.01)
    assert should_switch(cfg, step, loss) is expect


def test_profile_schedule():
    cfg = DSVConfig(profile_interval=25, profile_interval_after_warmup=100, profile_warmup_steps=1000)
    steps = [s for s in range(1400) if is_profile_step(s, cfg)]
    assert steps[:3] == [0, 25, 50] and 975 in steps and 1000 in steps and 1025 not in steps and 1100 in steps
    assert len(steps) == 40 + 4


def test_sampling_and_smoothing():
    idx = sampled_queries(256, 64, 3, "cpu")
    assert idx.tolist() == [3, 67, 131, 195]
    assert sampled_queries(10, 64, 5, "cpu").tolist() == [5]
    assert torch.allclose(smooth(torch.zeros(2), torch.ones(2), 0.9, first=True), torch.ones(2))
    assert torch.allclose(smooth(torch.zeros(2), torch.ones(2), 0.9, first=False), torch.full((2,), 0.1))


def test_profile_thinning_caps_the_profiled_queries():
    assert profile_thinning(1024, 1024) == 1 and profile_thinning(2048, 1024) == 2
    assert profile_thinning(8192, 1024) == 8 and profile_thinning(3000, 1024) == 3
    assert profile_thinning(5000, 0) == 1  # 0: no cap
    for n, cap in ((2048, 1024), (3000, 1024), (17, 4)):
        assert len(range(0, n, profile_thinning(n, cap))) <= cap


def test_profile_uses_at_most_the_cap(megatron_cpu, monkeypatch):
    """The profiler's oracle sees the sampled queries thinned to profile_max_queries; the predictor
    still gets every sampled query."""
    from megatron.core.transformer.enums import AttnMaskType

    import megatron_dsv.attention.core_attention as ca
    from tests.attention.conftest import dsv_config, planted, tf_config

    seen = []
    real = ca.profile_stats
    monkeypatch.setattr(ca, "profile_stats", lambda *a, **kw: seen.append(kw["query_index"]) or real(*a, **kw))
    q, k = planted(S=512, H=2, D=64, seed=1)
    for cap, want in ((0, 64), (16, 16), (20, 16)):  # stride 8: 64 sampled; cap 20 keeps one in 4
        seen.clear()
        layer = ca.DSVCoreAttention(tf_config(hidden=128, heads=2), 1, AttnMaskType.no_mask, "self",
                                    dsv_config=dsv_config(profile_max_queries=cap))
        layer.train()
        qs, ks = (t.permute(2, 0, 1, 3).contiguous() for t in (q, k))
        layer(qs, ks, ks.clone(), None)
        assert seen and all(idx.numel() == want for idx in seen), (cap, [i.numel() for i in seen])
        full = sampled_queries(512, 8, 0, "cpu")
        assert seen[0].tolist() == full[::profile_thinning(64, cap)].tolist()


@pytest.mark.parametrize("kw,name", [
    (dict(predictor_input="both"), "predictor_input"), (dict(profile_max_queries=-1), "profile_max_queries"), (dict(stage_switch_rule="never"), "stage_switch_rule"),
    (dict(stage_switch_rule="steps", stage_switch_steps=None), "stage_switch_steps"), (dict(theta=1.0), "theta"),
    (dict(sparsity_momentum=1.0), "sparsity_momentum"), (dict(query_group_shape=(3, 3, 3)), "query_group_shape"),
    (dict(predictor_rank=12), "predictor_rank"), (dict(k_min=0), "k_min"),
    (dict(budget_rule="tokens"), "budget_rule"), (dict(recall_target=0.0), "recall_target"),
    (dict(recall_target=1.5), "recall_target"), (dict(predictor_train_interval=-1), "predictor_train_interval"),
    (dict(predictor_train_interval=1.5), "predictor_train_interval"),
])
def test_bad_config_errors(kw, name):
    with pytest.raises(ValueError, match=name):
        DSVConfig(**kw)
    assert math.isfinite(DSVConfig().stage_switch_loss)


def test_budget_knob_defaults():
    c = DSVConfig()
    # the frontier's best point (NOTES_quality.md runs 2 and 3): the paper's rule with the auto neighbourhood,
    # every layer at 0.7 sparsity or more sparse
    assert (c.budget_rule, c.recall_target, c.predictor_train_interval, c.local_radius) == ("sparsity", 0.96, 1, None)
    assert c.sparsity_threshold == 0.7
    assert DSVConfig(recall_target=1.0, predictor_train_interval=0).recall_target == 1.0


def test_local_radius_auto_resolves_per_grid():
    c = DSVConfig()
    assert c.local_radius_for((16, 32, 32)) == (1, 1, 1)  # the 4x4x8 cube tiles it
    assert c.local_radius_for(None) is None  # text (GPT): no grid
    assert c.local_radius_for((21, 30, 52)) is None  # partial cubes (Wan's native grid)
    assert DSVConfig(granularity="token").local_radius_for((16, 32, 32)) is None
    assert DSVConfig(topk_backend="cuda").local_radius_for((16, 32, 32)) is None  # takes no local part
    assert DSVConfig(local_radius=(0, 0, 0)).local_radius_for((16, 32, 32)) is None
    assert DSVConfig(local_radius=(0, 1, 1)).local_radius_for(None) == (0, 1, 1)  # explicit: refused later
    with pytest.raises(ValueError, match="topk_backend"):
        DSVConfig(local_radius=(1, 1, 1), topk_backend="cuda")
    with pytest.raises(ValueError, match="local_radius"):
        DSVConfig(local_radius=(1, -1, 1))


def test_decisions_kept_over_plain_steps_and_renewed_by_a_profile(megatron_cpu, monkeypatch):
    """The dispatcher decides once per state: a step end that brings no profile and no stage switch keeps the
    layer's decision (plan_layer is not called again); a profile's step end, or a stage switch, renews it."""
    from megatron.core.transformer.enums import AttnMaskType

    import megatron_dsv.attention.core_attention as ca
    from tests.attention.conftest import dsv_config, force_state, planted, tf_config

    calls = []
    real = ca.plan_layer
    monkeypatch.setattr(ca, "plan_layer", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cfg = dsv_config(profile_interval=4, profile_interval_after_warmup=4, predictor_train_interval=0)
    layer = ca.DSVCoreAttention(tf_config(hidden=128, heads=2), 1, AttnMaskType.no_mask, "self", dsv_config=cfg)
    plain = next(s for s in range(1, 50) if not is_profile_step(s, cfg))
    profile = next(s for s in range(plain, 50) if is_profile_step(s, cfg))
    force_state(layer, stage=2, sparsity=0.9)
    layer.step.fill_(plain)
    layer._sync_host()
    q, k = planted(S=512, H=2, D=64, seed=2)
    qs, ks = (t.permute(2, 0, 1, 3).contiguous() for t in (q, k))
    layer.train()

    def step(number):  # one forward at the layer's step, then the step end numbering the next one
        layer(qs, ks, ks.clone(), None)
        layer.finish_step(layer.pending.detach().cpu().clone(), number, 2)

    step(plain)
    assert len(calls) == 1
    step(profile)  # the layer still runs step `plain`: nothing measured, the decision stays
    assert len(calls) == 1
    step(profile + 1)  # step `profile` (grad mode on: the pass that profiles): its measurement renews it
    layer(qs, ks, ks.clone(), None)
    assert len(calls) == 2
    layer.finish_step(torch.zeros_like(layer.pending).cpu(), profile + 2, 1)  # a stage switch renews it
    layer(qs, ks, ks.clone(), None)
    assert len(calls) == 3
