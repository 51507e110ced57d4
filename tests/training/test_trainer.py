"""Short in-process runs of the megatron-core trainer (gloo, world size 1, fp32 CPU)."""

import os
import re

import pytest
import torch

from tests.training.helpers import run


def test_loss_decreases_and_tensorboard(tmp_path):
    tb = tmp_path / "tb"
    result = run(tmp_path, "--train-iters", "30", "--no-save", "--tensorboard-dir", str(tb),
                 "--dsv-stage-switch-steps", "15")
    assert len(result.losses) == 30 and all(map(lambda x: x == x, result.losses))  # no NaN
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.9 * first, (first, last)
    assert result.dsv_stages[0] == 1 and result.dsv_stages[-1] == 2  # step rule switched mid-run
    pytest.importorskip("tensorboard")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))


@pytest.mark.parametrize("dsv", [False, True], ids=["dense", "dsv-stage-switch-across-checkpoint"])
def test_resume_reproduces_the_uninterrupted_loss_sequence(tmp_path, dsv):
    flags = ["--train-iters", "12", "--dsv-stage-switch-steps", "8"] + ([] if dsv else ["--no-dsv"])
    full = run(tmp_path, *flags, "--no-save", name="full")
    ckpt = tmp_path / "ckpt"
    first = run(tmp_path, *flags, "--save", str(ckpt), "--exit-interval", "5", name="first")
    assert first.iteration == 5 and (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    second = run(tmp_path, *flags, "--load", str(ckpt), "--save", str(ckpt), name="second")
    assert second.start_iteration == 5 and second.iteration == 12 and second.consumed_samples == 48
    assert first.losses + second.losses == full.losses  # exact float equality
    if dsv:
        assert first.dsv_stages + second.dsv_stages == full.dsv_stages and full.dsv_stages[-1] == 2
        from megatron_dsv.training.dsv_hooks import metrics

        # DSV state (predictors, smoothed sparsity, counters, stage) resumed exactly
        assert metrics(second.model) == metrics(full.model)


def test_log_line_format(tmp_path, capsys):
    run(tmp_path, "--train-iters", "2", "--no-save")
    out = capsys.readouterr().out
    pattern = (r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +2/ +2 \| consumed samples: 8 \| "
               r"elapsed time per iteration \(ms\): [\d.]+ \| tokens/s: \d+ \| learning rate: \d\.\d{3}E[-+]\d\d \| "
               r"loss: \d\.\d{6}E[-+]\d\d \| grad norm: [\d.]+ \| dsv stage: 1 \| dsv sparsity: [\d.]+ \|$")
    assert any(re.match(pattern, line) for line in out.splitlines()), out
    assert re.search(r"^ dsv layers \| L\d+: [\d.]+ (sparse|dense) \|", out, re.M), out
    run(tmp_path, "--train-iters", "1", "--no-save", "--no-dsv", name="dense")
    dense = capsys.readouterr().out
    assert re.search(r"grad norm: [\d.]+ \| dsv: off \|$", dense, re.M) and "dsv layers" not in dense


def test_dsv_config_of_a_checkpoint_from_before_a_default_keeps_what_it_trained():
    from megatron_dsv.config import DSVConfig
    from megatron_dsv.training.checkpointing import dsv_config_from_dict

    saved = DSVConfig(sparsity_threshold=0.6).to_dict()
    assert dsv_config_from_dict(saved).max_density == 0.25  # saved with the field: as saved
    del saved["max_density"]  # a checkpoint written before the field existed trained uncapped
    old = dsv_config_from_dict(saved)
    assert old.max_density is None and old.sparsity_threshold == 0.6
    import json  # the auto stage-1 window: saved as None (JSON null) and loaded as auto; before the field, dense
    saved = json.loads(json.dumps(DSVConfig().to_dict()))
    assert saved["stage1_local_radius"] is None and dsv_config_from_dict(saved).stage1_local_radius is None
    saved = json.loads(json.dumps(DSVConfig(stage1_local_radius=(1, 2, 1)).to_dict()))
    assert dsv_config_from_dict(saved).stage1_local_radius == (1, 2, 1)
    del saved["stage1_local_radius"]
    assert dsv_config_from_dict(saved).stage1_local_radius == (0, 0, 0)


def test_load_model_for_inference_matches_the_trained_weights(tmp_path):
    from megatron_dsv.training.checkpointing import load_model_for_inference

    result = run(tmp_path, "--train-iters", "3", "--save", str(tmp_path / "ckpt"))
    model, cfg = load_model_for_inference(str(tmp_path / "ckpt"), "cpu")
    assert cfg.layers == 2 and cfg.hidden == 64 and not model.training
    trained = result.model.state_dict()
    for name, value in model.state_dict().items():
        if isinstance(value, torch.Tensor) and not name.endswith("_extra_state"):
            assert torch.equal(value, trained[name]), name
    x = torch.randn(1, 4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(x, torch.tensor([0.5]), torch.tensor([1]))
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert result.checkpoint.endswith("iter_0000003")


def test_trains_on_latent_shards(tmp_path):
    from megatron_dsv.data import SyntheticVideoDataset, write_shard

    ds = SyntheticVideoDataset(12, channels=4, frames=4, height=8, width=8, num_classes=4, seed=5)
    shards = tmp_path / "shards"
    shards.mkdir()
    for part, rng in enumerate((range(0, 8), range(8, 12))):
        items = [ds[i] for i in rng]
        write_shard(str(shards / f"part{part}.safetensors"), torch.stack([it["latents"] for it in items]),
                    torch.stack([it["label"] for it in items]))
    result = run(tmp_path, "--train-iters", "4", "--no-save", "--data-path", str(shards))
    assert result.consumed_samples == 16 and len(result.losses) == 4  # 12 samples: wraps into epoch 2


def test_dataloader_workers_keep_the_batch_order(tmp_path):
    inline = run(tmp_path, "--train-iters", "3", "--no-save", "--no-dsv", name="inline")
    workers = run(tmp_path, "--train-iters", "3", "--no-save", "--no-dsv", "--num-workers", "1", name="workers")
    assert workers.losses == inline.losses


def test_resumed_run_logs_its_dsv_stage(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    run(tmp_path, "--train-iters", "3", "--dsv-stage-switch-steps", "2", "--save", str(ckpt), name="first")
    assert " > DSV stage 1 -> 2 after iteration 2" in capsys.readouterr().out
    run(tmp_path, "--train-iters", "4", "--dsv-stage-switch-steps", "2", "--load", str(ckpt), "--no-save",
        "--use-checkpoint-opt_param-scheduler", name="second")
    assert " > DSV resumes in stage 2 (sparse where the dispatcher says so)" in capsys.readouterr().out


@pytest.mark.parametrize("dsv", [False, True], ids=["dense", "dsv-into-stage-2"])
def test_validation_is_a_fixed_curve_that_leaves_training_alone(tmp_path, capsys, dsv):
    """--eval-interval / --eval-iters: held-out batches, noise and timesteps fixed across evaluations and
    runs; the training losses are those of a run without validation (bit for bit), also across a resume."""
    flags = ["--train-iters", "7", "--dsv-stage-switch-steps", "4", "--no-save"] + ([] if dsv else ["--no-dsv"])
    plain = run(tmp_path, *flags, "--eval-iters", "0", name="plain")
    assert plain.valid_losses == []
    evald = run(tmp_path, *flags, "--eval-interval", "3", "--eval-iters", "2", name="evald")
    assert evald.losses == plain.losses
    assert [it for it, _ in evald.valid_losses] == [3, 6, 7] and all(v == v for _, v in evald.valid_losses)
    out = capsys.readouterr().out
    assert re.search(r"^-+\n validation loss at iteration 6 \| loss: \d\.\d{6}E[-+]\d\d \| samples: 8 \| "
                     r"weights: EMA \(decay 0\.999\) \| elapsed time \(ms\): [\d.]+ \|\n-+$", out, re.M), out
    again = run(tmp_path, *flags, "--eval-interval", "3", "--eval-iters", "2", name="again")
    assert again.valid_losses == evald.valid_losses  # deterministic
    # a resumed run validates exactly as the uninterrupted one
    ckpt = str(tmp_path / "ckpt")
    resume_flags = [f for f in flags if f != "--no-save"] + ["--eval-interval", "3", "--eval-iters", "2"]
    first = run(tmp_path, *resume_flags, "--save", ckpt, "--exit-interval", "5", name="first")
    second = run(tmp_path, *resume_flags, "--load", ckpt, "--save", ckpt, name="second")
    assert first.valid_losses + second.valid_losses == evald.valid_losses
    assert first.losses + second.losses == plain.losses


def test_validation_data_flags(tmp_path, capsys):
    import numpy as np

    from megatron_dsv.data.shards import write_shard
    from megatron_dsv.training.arguments import parse_args

    shards = tmp_path / "shards"
    shards.mkdir()
    write_shard(str(shards / "shard_00000.safetensors"), torch.randn(6, 4, 4, 8, 8).half(),
                torch.from_numpy(np.arange(6) % 4))
    trained = run(tmp_path, "--train-iters", "2", "--no-save", "--data-path", str(shards), name="noval")
    assert trained.valid_losses == [] and "no --valid-data-path: no validation" in capsys.readouterr().out
    valid = run(tmp_path, "--train-iters", "2", "--no-save", "--data-path", str(shards), "--valid-data-path",
                str(shards), "--eval-iters", "1", name="val")
    assert [it for it, _ in valid.valid_losses] == [2]
    with pytest.raises(SystemExit):
        parse_args(["--valid-data-path", str(tmp_path / "missing")])
    assert "--valid-data-path must be an existing folder" in capsys.readouterr().err


def test_validation_runs_the_model_as_at_inference(tmp_path, monkeypatch):
    """Inside a validation: every DSV layer in eval mode, stage 2's layers sparse where the dispatcher says
    so, no draw from torch's global generator, and the same value when repeated at the same weights."""
    from megatron_dsv.attention import DSVCoreAttention
    from megatron_dsv.training import trainer

    seen = []
    real = trainer.evaluate

    def spy(loss_model, ddp_model, *args, **kwargs):
        hooks = [m.register_forward_hook(lambda mod, i, o: seen.append((mod.training, mod.last_sparse)))
                 for m in ddp_model.modules() if isinstance(m, DSVCoreAttention)]
        rng = torch.get_rng_state()
        try:
            value = real(loss_model, ddp_model, *args, **kwargs)
        finally:
            for h in hooks:
                h.remove()
        assert torch.equal(rng, torch.get_rng_state())
        assert real(loss_model, ddp_model, *args, **kwargs) == value
        return value

    monkeypatch.setattr(trainer, "evaluate", spy)
    # the CP tests' shape: these tiny models sit at ~0.36 sparsity; token lists at a 0.3 threshold run them sparse
    flags = ["--hidden-size", "128", "--model-override", "head_dim=64", "--model-override", "latent_height=16",
             "--model-override", "latent_width=16", "--micro-batch-size", "2", "--dsv-granularity", "token",
             "--dsv-sparsity-threshold", "0.3", "--dsv-profile-interval", "1", "--dsv-stage-switch-steps", "2"]
    result = run(tmp_path, *flags, "--train-iters", "3", "--eval-interval", "1", "--eval-iters", "1", "--no-save")
    assert len(result.valid_losses) == 3 and seen
    assert not any(training for training, _ in seen)
    assert any(sparse for _, sparse in seen), "stage 2's validation ran no layer sparse"
