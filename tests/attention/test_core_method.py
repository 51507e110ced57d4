"""DSVCoreAttention's method on its own: predictor learning, stage switch, sparse == dense at
full budget, eval mode, metrics, state-dict round trips (plain and dist_checkpointing)."""

import copy

import pytest
import torch

from megatron_dsv.attention import _ops, dsv_metrics, dsv_on_step_end, dsv_stage
from megatron_dsv.attention.schedule import sampled_queries
from megatron_dsv.ops.dense import dense_attention

from .conftest import as_megatron, dsv_config, force_state, planted, tf_config


def _same_decision(a, b, S=512):
    (sa, ba, ta), (sb, bb, tb) = a.decide(S), b.decide(S)
    return sa == sb and torch.equal(ba, bb) and torch.equal(ta, tb)


def _step(layer, seed, iteration, nuisance=10.0, v=None):
    q, k = planted(seed=seed, nuisance=nuisance)
    v = torch.randn_like(k) if v is None else v
    out = layer(as_megatron(q), as_megatron(k), as_megatron(v), None)
    dsv_on_step_end(layer, iteration)
    return out


def test_predictor_learns_planted_structure(make_layer):
    """>= 90% recall of the theta-critical mass within 60 steps, from a clearly lower start (at the
    sparsity rule's budgets: the recall rule would size the lists to reach the target at any quality)."""
    layer = make_layer(predictor_lr=1e-2, stage_switch_rule="steps", stage_switch_steps=10**6, budget_rule="sparsity")
    layer.train()
    recalls, losses = [], []
    for it in range(60):
        _step(layer, it, it + 1)
        m = dsv_metrics(layer)
        recalls.append(m["dsv/recall_mean"])
        losses.append(m["dsv/predictor_loss"])
        if recalls[-1] >= 0.9 and it >= 5:
            break
    assert recalls[0] < 0.85, recalls[0]
    assert max(recalls) >= 0.9, recalls
    assert losses[-1] < 0.5 * losses[0]
    assert 0.8 < m["dsv/sparsity_mean"] < 0.95  # 8 planted clusters
    # the recall is of the theta-critical mass: check one measurement against the oracle directly
    q, k = planted(seed=999, nuisance=10.0)
    qidx = sampled_queries(512, 8, 0, "cpu")
    budgets = torch.full((2,), 80)
    idx, counts = layer._estimate(q, k, None, budgets)
    recall = _ops.critical_mass_recall(q, k, idx, counts, 16, 0, 0.9, None, qidx)
    assert float(recall.mean()) >= 0.85


def test_stage_switch_on_loss_rule(make_layer):
    layer = make_layer(predictor_lr=1e-2, stage_switch_rule="loss", stage_switch_loss=0.1)
    layer.train()
    for it in range(80):
        _step(layer, it, it + 1)
        if dsv_stage(layer) == 2:
            break
    assert dsv_stage(layer) == 2
    assert float(layer.predictor_loss[0]) < 0.1
    assert it >= 2  # not on the first step: the initial predictor loss is far above 0.1


def test_stage_switch_on_step_rule_and_sparse_forward(make_layer):
    layer = make_layer(stage_switch_rule="steps", stage_switch_steps=3, sparsity_threshold=0.5)
    layer.train()
    for it in range(3):
        assert dsv_stage(layer) == 1
        _step(layer, it, it + 1)
        assert not layer.last_sparse
    assert dsv_stage(layer) == 2
    _step(layer, 3, 4)
    m = dsv_metrics(layer)
    assert layer.last_sparse and m["dsv/layer1/sparse"] == 1.0
    assert 16 <= m["dsv/k_mean"] < 512
    layer.force_dense = True  # the run-time switch (bench_recall's dense arm) overrides the dispatcher
    _step(layer, 4, 5)
    assert not layer.last_sparse and dsv_metrics(layer)["dsv/layer1/k_mean"] == 512
    layer.force_dense = False
    _step(layer, 5, 6)
    assert layer.last_sparse
    assert set(m) >= {"dsv/stage", "dsv/predictor_loss", "dsv/sparsity_mean", "dsv/layer1/sparsity",
                      "dsv/layer1/sparsity_measured",
                      "dsv/layer1/recall", "dsv/layer1/k_mean", "dsv/layer1/head0/sparsity", "dsv/layer1/head1/k"}


@pytest.mark.parametrize("backend,granularity", [("naive", "token"), ("naive", "block"), ("auto", "block")])
def test_full_budget_sparse_equals_dense(make_layer, fast_table, backend, granularity):
    """Stage 2, sparsity 0 -> budget 100% (no cap): the sparse path (estimation + kernel) equals dense."""
    layer = make_layer(kernel_backend=backend, granularity=granularity, sparsity_threshold=0.0,
                       speedup_table=fast_table, max_density=None)
    force_state(layer, stage=2, sparsity=0.0)
    layer.eval()
    q, k = planted(S=256)
    v = torch.randn_like(k)
    with torch.no_grad():
        out = layer(as_megatron(q), as_megatron(k), as_megatron(v), None)
    assert layer.last_sparse
    ref = dense_attention(q, k, v).permute(2, 0, 1, 3).reshape(256, 1, -1)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_gqa_and_sparse_backward(make_layer, fast_table):
    tf = tf_config(heads=4, kv_heads=2, hidden=256)
    layer = make_layer(tf=tf, sparsity_threshold=0.5, speedup_table=fast_table)
    force_state(layer, stage=2, sparsity=0.8)
    layer.train()
    q = torch.randn(256, 1, 4, 64, requires_grad=True)
    k = torch.randn(256, 1, 2, 64, requires_grad=True)
    v = torch.randn(256, 1, 2, 64, requires_grad=True)
    out = layer(q, k, v, None)
    out.square().mean().backward()
    assert layer.last_sparse and out.shape == (256, 1, 256)
    assert all(torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in (q, k, v))
    assert layer.predictor.wq.grad is None  # the predictor never joins the main backward
    assert float(layer.predictor.grad_count[0]) == 1


def test_eval_mode_does_not_train(make_layer):
    layer = make_layer()
    layer.eval()
    before = copy.deepcopy(layer.state_dict())
    q, k = planted()
    with torch.no_grad():
        layer(as_megatron(q), as_megatron(k), as_megatron(torch.randn_like(k)), None)
    assert float(layer.predictor.grad_count[0]) == 0 and float(layer.pending.abs().sum()) == 0
    dsv_on_step_end(layer, 1)
    after = layer.state_dict()
    for name in before:
        if name not in ("step",):
            torch.testing.assert_close(before[name], after[name], rtol=0, atol=0, equal_nan=True, msg=name)


def test_padding_mask_runs_dense(make_layer, fast_table):
    from megatron.core.transformer.enums import AttnMaskType

    layer = make_layer(sparsity_threshold=0.0, speedup_table=fast_table)
    layer.attn_mask_type = AttnMaskType.padding
    force_state(layer, stage=2, sparsity=0.5)
    q, k = planted(S=128)
    mask = torch.zeros(1, 1, 1, 128, dtype=torch.bool)
    mask[..., 100:] = True
    out = layer(as_megatron(q), as_megatron(k), as_megatron(k), mask, attn_mask_type=AttnMaskType.padding)
    assert not layer.last_sparse and torch.isfinite(out).all()
    assert float(layer.predictor.grad_count[0]) == 0


def _train(layer, steps, start=0):
    layer.train()
    outs = []
    for it in range(start, start + steps):
        torch.manual_seed(it)
        outs.append(_step(layer, it, it + 1))
    return outs


def test_state_dict_round_trip(make_layer):
    kw = dict(predictor_lr=1e-2, stage_switch_rule="steps", stage_switch_steps=4, sparsity_threshold=0.5)
    a = make_layer(**kw)
    _train(a, 5)
    assert dsv_stage(a) == 2
    b = make_layer(layer_number=7, **kw)  # different init: everything must come from the state dict
    b.load_state_dict(a.state_dict())
    assert dsv_stage(b) == 2 and b.step_host == a.step_host
    assert _same_decision(a, b)
    # identical outputs, decisions, predictor updates and metrics when both continue training
    outs_a, outs_b = _train(a, 3, start=5), _train(b, 3, start=5)
    for x, y in zip(outs_a, outs_b):
        assert torch.equal(x, y)
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name]), name
    ma = {k.replace("layer1", "L"): v for k, v in dsv_metrics(a).items()}
    mb = {k.replace("layer7", "L"): v for k, v in dsv_metrics(b).items()}
    assert ma == mb


def test_state_stays_fp32_under_bf16_cast(make_layer):
    layer = make_layer().bfloat16()
    assert layer.predictor.wq.dtype == torch.float32 and layer.sparsity.dtype == torch.float32
    assert layer.predictor.wq_exp_avg.dtype == torch.float32


def test_sharded_state_dict(make_layer):
    """Every piece of DSV state is a ShardedTensor: per-head tensors sharded along heads (TP axis 0),
    scalars replicated; the data behind them is the module's own tensors."""
    from megatron.core.dist_checkpointing import ShardedTensor

    a = make_layer(stage_switch_rule="steps", stage_switch_steps=2, predictor_lr=1e-2)
    _train(a, 3)
    sharded = a.sharded_state_dict(prefix="attn.")
    plain = a.state_dict()
    assert set(sharded) == {"attn." + k for k in plain}
    for name, t in plain.items():
        st = sharded["attn." + name]
        assert isinstance(st, ShardedTensor) and st.key == "attn." + name
        assert torch.equal(st.data, t)
        assert st.global_shape == tuple(t.shape)  # tp = 1
    # a fresh layer loads what the sharded dict names (dist_checkpointing hands back these tensors)
    b = make_layer(layer_number=3, stage_switch_rule="steps", stage_switch_steps=2)
    b.load_state_dict({k[len("attn."):]: v.data for k, v in sharded.items()})
    assert dsv_stage(b) == 2 and _same_decision(a, b)


def test_bad_inputs(make_layer):
    layer = make_layer()
    with pytest.raises(ValueError, match="iteration"):
        dsv_on_step_end(layer, -1)
    with pytest.raises(ValueError, match="model"):
        dsv_on_step_end([layer, "x"], 1)
    hidden = make_layer(predictor_input="hidden")
    hidden.train()
    q, k = planted(S=128)
    with pytest.raises(ValueError, match="hidden"):
        hidden(as_megatron(q), as_megatron(k), as_megatron(k), None)


def test_config_backends_are_honoured(make_layer, fast_table, monkeypatch):
    """kernel_backend / topk_backend other than auto/naive reach the named backend (not the auto choice)."""
    with pytest.raises(ValueError, match="kernel_backend='flex'"):
        make_layer(kernel_backend="flex")  # G=16, token lists: flex cannot lower them
    layer = make_layer(topk_backend="cuda", sparsity_threshold=0.0, speedup_table=fast_table)
    force_state(layer, stage=2, sparsity=0.5)
    layer.eval()
    q, k = planted(S=256)
    with torch.no_grad(), pytest.raises(ValueError, match="cuda backend needs CUDA tensors"):
        layer(as_megatron(q), as_megatron(k), as_megatron(k), None)
    calls = []
    monkeypatch.setattr("megatron_dsv.ops.sparse_attention.op._fwd_impl",
                        lambda q, *a: calls.append(a) or (torch.zeros_like(q), None))
    layer = make_layer(kernel_backend="triton", sparsity_threshold=0.0, speedup_table=fast_table)
    force_state(layer, stage=2, sparsity=0.5)
    layer.eval()
    with torch.no_grad():
        layer(as_megatron(q), as_megatron(k), as_megatron(k), None)
    assert layer.last_sparse and len(calls) == 1 and calls[0][-1] is False  # no host-syncing value check


def test_backend_environment_is_read_at_construction(make_layer, fast_table, monkeypatch):
    """With 'auto' in the config, DSV_SPARSE_ATTN_BACKEND / DSV_TOPK_BACKEND force a backend when the
    layer is built; later changes to them do not reach its forwards."""
    monkeypatch.setenv("DSV_TOPK_BACKEND", "fastest")
    with pytest.raises(ValueError, match="DSV_TOPK_BACKEND"):
        make_layer(kernel_backend="auto", topk_backend="auto")
    monkeypatch.setenv("DSV_TOPK_BACKEND", "naive")
    monkeypatch.setenv("DSV_SPARSE_ATTN_BACKEND", "naive")
    layer = make_layer(kernel_backend="auto", topk_backend="auto", sparsity_threshold=0.0, speedup_table=fast_table)
    assert (layer.kernel_backend, layer.topk_backend) == ("naive", "naive")
    monkeypatch.setenv("DSV_TOPK_BACKEND", "fastest")
    monkeypatch.setenv("DSV_SPARSE_ATTN_BACKEND", "fastest")
    force_state(layer, stage=2, sparsity=0.5)
    layer.eval()
    q, k = planted(S=256)
    with torch.no_grad():
        layer(as_megatron(q), as_megatron(k), as_megatron(k), None)
    assert layer.last_sparse
