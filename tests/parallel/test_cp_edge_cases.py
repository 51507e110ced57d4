"""DSV context parallelism: the cases tests/parallel/test_cp_attention.py does not cover (gloo, CPU).

One spawned world per test (``spawn.run_world``), each running several checks:

* ``DSVCoreAttention`` under CP against the same layer without CP, batch 2 and GQA (4 query heads,
  2 key/value heads), token lists (G=16) and block lists (G=64, 64-key blocks; also with the default windowed
  stage 1 and local + predicted lists on a token grid), over several steps
  (stage 1 with the profiler and the predictor, the stage switch, stage 2 sparse): outputs, dq, dk,
  dv every step; after every step end the profiled sparsity, budget density, recall, predictor
  weights and Adam state, stage and ``cp_plan_state`` are identical on every CP rank and equal to one
  process; a ``torch.no_grad()`` eval forward (validation, sampling) equals one process too.
* world 4: the ``hcp_inner=False`` layout (and every other layout) forced through ``DSVCoreAttention``.
* ``VideoDiT`` with ``predictor_input='hidden'`` (``DSVSelfAttention`` hands hidden states to the core)
  built with a CP ``pg_collection`` against one built without: outputs and parameter gradients of the
  whole model, batch 2, training and ``no_grad`` eval.
* error paths: a shard that is not a multiple of the query group / key block (the error names the
  flag), a padding attention mask under CP, sampled-query shares that differ between CP ranks.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.parallel.spawn import run_world

H, HKV, D = 4, 2, 64


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(name, got, want, atol=2e-5):
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    assert err <= atol * max(1.0, want.float().abs().max().item() if want.numel() else 0.0), \
        f"{name}: max error {err:.3g}"


def _shard(t, rank, world, dim=0):
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n)


def _same_on_all_ranks(name, t):
    """``t`` bitwise identical on every rank of the world."""
    t = t.detach().double().contiguous()
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    for r, other in enumerate(everyone):
        assert torch.equal(other, t), f"{name} differs between rank {dist.get_rank()} and rank {r}"


STATE = ("sparsity", "budget_density", "recall", "predictor_loss", "stage", "step", "profiles")


def _layers(cfg, tf, pg_cp):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dsv.attention.core_attention import DSVCoreAttention

    return {name: DSVCoreAttention(tf, 1, AttnMaskType.no_mask, "self", dsv_config=cfg,
                                   pg_collection=SimpleNamespace(tp=None, cp=group))
            for name, group in (("one", None), ("cp", pg_cp))}


def _inputs(seed, S, B):
    from tests.attention.conftest import planted

    q, _ = planted(S=S, H=H, D=D, B=B, seed=seed)
    k = planted(S=S, H=HKV, D=D, B=B, seed=seed + 1)[1]  # GQA: 2 key/value heads
    v = _randn(seed + 2, B, HKV, S, D)
    do = _randn(seed + 3, S, B, H * D)
    return [t.permute(2, 0, 1, 3).contiguous() for t in (q, k, v)], do  # Megatron's [s, b, heads, hn]


def _step(layers, rank, world, seed, S, B, what, grad=True):
    """One forward (+ backward) of both layers on the same inputs; outputs and input grads compared."""
    (q, k, v), do = _inputs(seed, S, B)
    outs = {}
    for name, layer in layers.items():
        ins = [t.clone() if name == "one" else _shard(t, rank, world).clone() for t in (q, k, v)]
        if grad:
            ins = [t.requires_grad_() for t in ins]
            out = layer(*ins, None)
            out.backward(do if name == "one" else _shard(do, rank, world))
        else:
            with torch.no_grad():
                out = layer(*ins, None)
        outs[name] = (out, ins)
    (out1, in1), (outc, inc) = outs["one"], outs["cp"]
    _close(f"{what} out rank {rank}", outc, _shard(out1, rank, world))
    if grad:
        for n, a, b in zip("qkv", inc, in1):
            _close(f"{what} d{n} rank {rank}", a.grad, _shard(b.grad, rank, world))
    return layers["one"].last_sparse, layers["cp"].last_sparse


def _check_state(layers, what):
    one, cp = layers["one"], layers["cp"]
    for name in STATE:
        _same_on_all_ranks(f"{what} {name}", getattr(cp, name))
        _close(f"{what} state {name}", getattr(cp, name), getattr(one, name), atol=1e-5)
    _same_on_all_ranks(f"{what} cp_plan_state", cp.cp_plan_state)
    for (name, a), (_, b) in zip(cp.predictor.state_dict().items(), one.predictor.state_dict().items()):
        _same_on_all_ranks(f"{what} predictor {name}", a)
        _close(f"{what} predictor {name}", a, b, atol=1e-5)
    assert cp.stage_host == one.stage_host and cp.profiled_host == one.profiled_host


def _run_steps(rank, world, cfg, S, B, steps, tag, grid=None):
    """``steps`` training steps of a CP layer beside one process, then a no_grad eval forward (``grid``: the
    token grid given to both, for the neighbourhoods of local lists and of a windowed stage 1)."""
    from megatron_dsv.attention import dsv_on_step_end, dsv_set_token_grid
    from tests.attention.conftest import tf_config

    torch.manual_seed(0)
    layers = _layers(cfg, tf_config(hidden=H * D, heads=H, kv_heads=HKV), dist.group.WORLD)
    dsv_set_token_grid(list(layers.values()), grid)
    ran_sparse = False
    for step in range(1, steps + 1):
        sparse_one, sparse_cp = _step(layers, rank, world, 100 * step, S, B, f"{tag} step {step}")
        assert sparse_one == sparse_cp, f"{tag} step {step}: one process sparse={sparse_one}, CP sparse={sparse_cp}"
        if grid is not None and layers["cp"].stage_host == 1 and cfg.stage1_radius_for(grid) is not None:
            keys = [float(layers[n].last_k.max()) for n in ("one", "cp")]  # stage 1 attended the window
            assert keys[0] == keys[1] < S, f"{tag} step {step}: stage-1 keys {keys} of {S}"
        ran_sparse |= sparse_cp
        for layer in layers.values():
            dsv_on_step_end(layer, step)
        _check_state(layers, f"{tag} after step {step}")
    assert ran_sparse, f"{tag}: stage 2 must run some steps sparse"
    assert layers["cp"].cp_plan is not None and int(layers["cp"].cp_plan_state[0, 0]) > 0
    for layer in layers.values():  # validation / sampling: eval mode under no_grad
        layer.eval()
    sparse_one, sparse_cp = _step(layers, rank, world, 999, S, B, f"{tag} eval no_grad", grad=False)
    assert sparse_one == sparse_cp
    for layer in layers.values():  # no_grad in training mode (e.g. an EMA or logging pass)
        layer.train()
    _step(layers, rank, world, 998, S, B, f"{tag} train no_grad", grad=False)
    _check_state(layers, f"{tag} after the no_grad passes")
    return layers


def _check_errors(rank, world):
    from tests.attention.conftest import dsv_config, tf_config

    cfg = dsv_config(cp_mode="hybrid", stage_switch_rule="steps", stage_switch_steps=2, predictor_query_stride=8)
    layers = _layers(cfg, tf_config(hidden=H * D, heads=H, kv_heads=HKV), dist.group.WORLD)
    cp = layers["cp"]
    # a shard of 24 tokens is not a whole number of 16-token query groups: the error names the knob
    q, k, v = _randn(1, 24, 1, H, D), _randn(2, 24, 1, HKV, D), _randn(3, 24, 1, HKV, D)
    with pytest.raises(ValueError, match="query_group_shape"):
        cp(q, k, v, None)
    # block granularity: the key block (64) must divide the shard too
    bcfg = dsv_config(cp_mode="seq", granularity="block", query_group_shape=(1, 4, 4), kv_block_size=64)
    blayer = _layers(bcfg, tf_config(hidden=H * D, heads=H, kv_heads=HKV), dist.group.WORLD)["cp"]
    q, k, v = _randn(1, 32, 1, H, D), _randn(2, 32, 1, HKV, D), _randn(3, 32, 1, HKV, D)
    with pytest.raises(ValueError, match="kv_block_size"):
        blayer(q, k, v, None)
    # sampled queries (1 in predictor_query_stride) must split evenly over the CP ranks, or the ranks'
    # averaged statistics are not one process's: a shard of 48 tokens with stride 32 is rejected, naming the knob
    scfg = dsv_config(cp_mode="hybrid", predictor_query_stride=32)
    slayer = _layers(scfg, tf_config(hidden=H * D, heads=H, kv_heads=HKV), dist.group.WORLD)["cp"]
    q, k, v = _randn(1, 48, 1, H, D), _randn(2, 48, 1, HKV, D), _randn(3, 48, 1, HKV, D)
    with pytest.raises(ValueError, match="predictor_query_stride"):
        slayer(q, k, v, None)
    slayer.eval()  # no sampling in eval: any shard of whole query groups runs
    with torch.no_grad():
        assert slayer(q, k, v, None).shape == (48, 1, H * D)


def _check_padding_mask(rank, world):
    from megatron.core.transformer.enums import AttnMaskType

    from tests.attention.conftest import dsv_config, tf_config

    cfg = dsv_config(cp_mode="hybrid", predictor_query_stride=8)
    cp = _layers(cfg, tf_config(hidden=H * D, heads=H, kv_heads=HKV), dist.group.WORLD)["cp"]
    q, k, v = _randn(1, 32, 1, H, D), _randn(2, 32, 1, HKV, D), _randn(3, 32, 1, HKV, D)
    for sk in (32, 32 * world):  # a mask over the shard's keys, or over the whole sequence's
        mask = torch.zeros(1, 1, 1, sk, dtype=torch.bool)
        with pytest.raises(ValueError, match="padding"):
            cp(q, k, v, mask, attn_mask_type=AttnMaskType.padding)


def _check_world2(rank, world):
    from tests.attention.conftest import dsv_config

    _check_errors(rank, world)
    common = dict(stage_switch_rule="steps", stage_switch_steps=2, sparsity_threshold=0.2, predictor_query_stride=8)
    # token lists, batch 2, GQA
    _run_steps(rank, world, dsv_config(cp_mode="hybrid", **common), S=256, B=2, steps=4, tag="token hybrid B=2 GQA")
    # block lists: query groups of 64, 64-key blocks
    _run_steps(rank, world, dsv_config(cp_mode="seq", granularity="block", query_group_shape=(1, 8, 8),
                                       kv_block_size=64, k_min=1, budget_rule="sparsity",
                                       **{**common, "sparsity_threshold": 0.0}),
               S=512, B=2, steps=4, tag="block G64 seq B=2 GQA")
    # the same with the default stage-1 window on a 1x8x64 grid (a row of eight 1x8x8 cubes: the (2, 2, 1) window keeps
    # 22 of 64 cube pairs) and local + predicted lists in stage 2, under the hybrid planner
    layers = _run_steps(rank, world, dsv_config(cp_mode="hybrid", granularity="block", query_group_shape=(1, 8, 8),
                                                kv_block_size=64, k_min=1, budget_rule="sparsity", local_radius=None,
                                                **{**common, "sparsity_threshold": 0.0}),
                        S=512, B=2, steps=4, tag="block G64 hybrid B=2 GQA stage-1 window", grid=(1, 8, 64))
    assert layers["cp"].dsv_config.stage1_radius_for((1, 8, 64)) == (2, 2, 1)


def _check_world4_layouts(rank, world):
    import megatron_dsv.parallel.cp_attention as cpa
    from megatron_dsv.parallel.groups import cp_layouts
    from tests.attention.conftest import dsv_config

    common = dict(stage_switch_rule="steps", stage_switch_steps=1, sparsity_threshold=0.2, predictor_query_stride=8)
    original = cpa.layouts_for_mode
    try:
        for layout in [l for l in cp_layouts(world) if not l.hcp_inner] + [l for l in cp_layouts(world) if l.hcp_inner]:
            cpa.layouts_for_mode = lambda mode, groups, layout=layout: [layout]
            layers = _run_steps(rank, world, dsv_config(cp_mode="hybrid", **common), S=256, B=2, steps=2,
                                tag=f"forced {layout.name}")
            assert layers["cp"].cp_plan.layout == layout
    finally:
        cpa.layouts_for_mode = original


def _check_video_dit(rank, world):
    from megatron.core import parallel_state

    from megatron_dsv.attention import dsv_on_step_end
    from megatron_dsv.config import DSVConfig
    from megatron_dsv.models.video_dit import VideoDiTConfig, build_video_dit, flow_matching_loss
    from megatron_dsv.attention.hooks import dsv_layers
    from megatron.core.process_groups_config import ProcessGroupCollection

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        pg = ProcessGroupCollection.use_mpu_process_groups()
        singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
        pg_one = copy.copy(pg)
        pg_one.cp = singles[rank]
        cfg = VideoDiTConfig(in_channels=4, latent_frames=4, latent_height=16, latent_width=16, patch=(1, 2, 2),
                             hidden=256, layers=2, heads=4, head_dim=64, num_classes=4, class_dropout_prob=0.0)
        dsv = DSVConfig(query_group_shape=(1, 4, 4), granularity="token", k_min=16, kernel_backend="naive",
                        topk_backend="naive", predictor_query_stride=8, profile_interval=1, predictor_input="hidden",
                        stage_switch_rule="steps", stage_switch_steps=1, sparsity_threshold=0.0, cp_mode="hybrid",
                        budget_rule="sparsity")
        models = {}
        for name, group in (("one", pg_one), ("cp", pg)):
            torch.manual_seed(5)
            models[name] = build_video_dit(cfg, dsv_config=dsv, use_te=False, pg_collection=group,
                                           use_cpu_initialization=True)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # adaLN-Zero starts at velocity 0: give every weight a value
            for p in models["one"].parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        models["cp"].load_state_dict(models["one"].state_dict())
        x = torch.randn(2, 4, 4, 16, 16, generator=g)
        labels = torch.tensor([1, 3])
        ran_sparse = False
        for step in (1, 2, 3):
            losses = {}
            for name, model in models.items():
                model.zero_grad(set_to_none=True)
                loss = flow_matching_loss(model, x, labels, generator=torch.Generator().manual_seed(step))
                loss.backward()
                losses[name] = loss
            _close(f"dit step {step} loss", losses["cp"], losses["one"], atol=1e-5)
            sparse = [layer.last_sparse for layer in dsv_layers(models["cp"])]
            assert sparse == [layer.last_sparse for layer in dsv_layers(models["one"])]
            ran_sparse |= any(sparse)
            for (name, a), (_, b) in zip(models["cp"].named_parameters(), models["one"].named_parameters()):
                assert (a.grad is None) == (b.grad is None), f"dit step {step} grad {name}: None on one side"
                if a.grad is None:  # the DSV predictors: trained at the step end, outside autograd
                    continue
                grad = a.grad.clone()
                dist.all_reduce(grad)  # the DP x CP gradient average of Megatron's DDP (DP = 1 here)
                _close(f"dit step {step} grad {name}", grad / world, b.grad, atol=1e-4)
            for name, model in models.items():
                dsv_on_step_end(model, step, dp_group=dist.group.WORLD if name == "cp" else singles[rank])
            for lc, lo in zip(dsv_layers(models["cp"]), dsv_layers(models["one"])):
                _check_state({"cp": lc, "one": lo}, f"dit after step {step} layer {lc.layer_number}")
        assert ran_sparse, "stage 2 must run some DiT layers sparse"
        with pytest.raises(ValueError, match="query_group_shape"):  # 16 tokens = one cube: no 2 whole-cube shards
            models["cp"](torch.randn(1, 4, 1, 8, 8), torch.tensor([0.5]), torch.tensor([1]))
        for model in models.values():
            model.eval()
        with torch.no_grad():
            t = torch.tensor([0.3, 0.8])
            _close("dit eval no_grad", models["cp"](x, t, labels), models["one"](x, t, labels), atol=1e-5)
    finally:
        parallel_state.destroy_model_parallel()


def test_core_attention_cp_batch_gqa_blocks_steps_eval_and_errors(tmp_path):
    run_world(_check_world2, 2, tmp_path)


def test_padding_mask_under_cp_raises(tmp_path):
    """A padding mask cannot be applied to sharded keys: a clear error, never a silently local attention."""
    run_world(_check_padding_mask, 2, tmp_path)


def test_core_attention_cp_every_forced_layout_world4(tmp_path):
    run_world(_check_world4_layouts, 4, tmp_path)


def test_video_dit_hidden_predictor_under_cp_matches_one_process(tmp_path):
    run_world(_check_video_dit, 2, tmp_path)
