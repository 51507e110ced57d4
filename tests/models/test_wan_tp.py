"""Wan2.1 at tensor parallelism 2 and context parallelism 2 (two gloo processes on the CPU): the same output
as diffusers at TP=2 and at CP=2 (DSV stage 1), the exact export, dist checkpoints written at TP=1 read at
TP=2 and the reverse, and the q/k norms' gradients summed over TP.

The workers import only this module and megatron_dsv (not diffusers, slow to import): diffusers runs in
the pytest process."""

import os

import pytest
import torch

from megatron_dsv.models.wan import build_wan
from megatron_dsv.models.wan_config import WanConfig
from megatron_dsv.models.wan_convert import (diffusers_to_ours, full_state_from_model, load_diffusers_folder,
                                             load_into_model, load_megatron_checkpoint, ours_to_diffusers,
                                             save_megatron_checkpoint)

LATENT = (4, 16, 16)


def _inputs(batch=2, seed=1, channels=4, text_dim=32):
    # the same draws as test_wan._inputs
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, *LATENT, generator=g)
    t = torch.rand(batch, generator=g)
    text = torch.randn(batch, 7, text_dim, generator=g)
    return x, t, text


def _converted(folder, dsv_config=None, pg_collection=None, **overrides):
    overrides.setdefault("use_cpu_initialization", True)  # CPU worlds on a GPU host too, as test_wan._converted
    config, state = load_diffusers_folder(folder)
    cfg = WanConfig.from_diffusers(config, latent_grid=LATENT)
    model = build_wan(cfg, dsv_config=dsv_config, use_te=False, pg_collection=pg_collection, **overrides)
    load_into_model(model, diffusers_to_ours(state, cfg))
    return model, cfg, state


def _tp2_worker(rank, world, folder, out_dir):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model, cfg, state = _converted(folder, tensor_model_parallel_size=2)
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.shape == (3 * cfg.hidden // 2, cfg.hidden)  # this rank's heads only
    model.eval()
    x, t, text = _inputs()
    with torch.no_grad():
        out = model(x, t, text=text)
    back = ours_to_diffusers(full_state_from_model(model), cfg)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    save_megatron_checkpoint(model, os.path.join(out_dir, "ckpt_tp2"))
    # the one-process (TP=1) conversion, read at TP=2: the same shards, bit for bit
    fresh = build_wan(cfg, use_te=False, tensor_model_parallel_size=2, use_cpu_initialization=True)
    load_megatron_checkpoint(fresh, os.path.join(out_dir, "ckpt_tp1"))
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name
    if rank == 0:
        torch.save(out, os.path.join(out_dir, "out_tp2.pt"))
    # a backward through the q/k norms (their mean square is summed over the TP group); their replicated
    # gains get a partial gradient per rank, summed over TP as the trainer does before its optimizer step
    from megatron_dsv.training.optim import sum_partial_grads_over_tp

    model.train()
    model(x, t, text=text).square().mean().backward()
    norm = model.decoder.layers[0].self_attention.q_layernorm.weight
    assert norm.shape == (cfg.hidden,) and not getattr(norm, "tensor_model_parallel", False)
    partial = norm.grad.clone()
    sum_partial_grads_over_tp(model, parallel_state.get_tensor_model_parallel_group())
    assert not torch.equal(partial, norm.grad)  # the other rank's heads contributed
    torch.save(norm.grad, os.path.join(out_dir, f"qnorm_grad_{rank}.pt"))
    parallel_state.destroy_model_parallel()
    _cp2(rank, folder, out_dir)


def _cp2(rank, folder, out_dir):
    # the same world as context parallelism 2 with DSV (stage 1: dense, through DSV's CP path): each rank
    # keeps half of the cube-ordered video; the text cross-attention is local on every rank
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_dsv.config import DSVConfig

    parallel_state.initialize_model_parallel(context_parallel_size=2)
    dsv = DSVConfig(query_group_shape=(1, 4, 4), kernel_backend="naive", topk_backend="naive", k_min=16,
                    predictor_query_stride=8, cp_mode="hybrid")
    model, _, _ = _converted(folder, dsv_config=dsv, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    model.train()
    x, t, text = _inputs()
    out = model(x, t, text=text)
    out.square().mean().backward()
    assert torch.isfinite(model.patch_embed.weight.grad).all()
    if rank == 0:
        torch.save(out.detach(), os.path.join(out_dir, "out_cp2.pt"))


def test_tp2_and_cp2_match_diffusers(megatron_cpu, tmp_path):
    pytest.importorskip("diffusers", reason="diffusers is not installed: pip install -e .[wan] (or .[test])")
    from tests.models.test_wan import REL_TOL, _reference, _rel, _tiny_diffusers
    from tests.parallel.spawn import run_world

    folder = str(tmp_path / "wan_tiny")
    _tiny_diffusers().save_pretrained(folder, safe_serialization=True)
    save_megatron_checkpoint(_converted(folder)[0], str(tmp_path / "ckpt_tp1"))
    run_world(_tp2_worker, 2, tmp_path, deadline_s=120.0, args=(folder, str(tmp_path)))
    x, t, text = _inputs()
    ref = _reference(folder, x, t, text)
    assert _rel(ref, torch.load(tmp_path / "out_tp2.pt")) < REL_TOL
    assert _rel(ref, torch.load(tmp_path / "out_cp2.pt")) < REL_TOL
    # the TP=2 checkpoint reads into a TP=1 model (dist_checkpointing reshards): the same weights
    model, cfg, state = _converted(folder)
    fresh = build_wan(cfg, use_te=False, use_cpu_initialization=True)
    load_megatron_checkpoint(fresh, str(tmp_path / "ckpt_tp2"))
    back = ours_to_diffusers(full_state_from_model(fresh), cfg)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    model.train()
    model(x, t, text=text).square().mean().backward()
    grad = model.decoder.layers[0].self_attention.q_layernorm.weight.grad
    for r in range(2):  # every rank's summed gradient is the one-process gradient
        torch.testing.assert_close(torch.load(tmp_path / f"qnorm_grad_{r}.pt"), grad, rtol=1e-4, atol=1e-6)
