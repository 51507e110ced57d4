"""Arm keys of the study's training runs (``benchmarks/video_runs.py``): DSV's list granularity, the footage source."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.video_runs import parse_arm  # noqa: E402

# starts, counts (frontier_launch.running_workers) or stops processes by name: in tests/conftest.py's PROCESS_FILES


def test_gran_key_parses_labels_and_rejects_unknown():
    assert parse_arm("data=synthetic")["gran"] == "block"
    arm = parse_arm("data=synthetic,frames=4,res=64,gran=token")
    assert arm["gran"] == "token" and arm["label"] == "synthetic-dsv-tokenlists-S256"
    assert parse_arm("data=synthetic,frames=4,res=64,gran=token,attn=full")["label"] == "synthetic-full-S256"
    with pytest.raises(ValueError, match="gran must be one of"):
        parse_arm("gran=tokens")


def test_local_auto_and_threshold_keys():
    arm = parse_arm("data=synthetic,frames=4,res=64,rule=sparsity,local=auto,thr=0.7")
    assert arm["local_radius"] is None and arm["thr"] == 0.7
    assert arm["label"] == "synthetic-dsv-paperrule-thr0.7-localauto-S256"
    assert parse_arm("data=synthetic,frames=4,res=64")["thr"] == 0.8
    with pytest.raises(ValueError, match="arm local must be"):
        parse_arm("local=1.1")


def test_lmode_key_reaches_the_label_and_rejects_unknown():
    """lmode (DSVConfig.local_mode): 'shared' by default, absent from the label (runs saved before the key keep
    their paths); 'window' named in it."""
    assert parse_arm("data=synthetic")["lmode"] == "shared"
    arm = parse_arm("data=synthetic,frames=4,res=64,rule=sparsity,local=1.1.0,lmode=window")
    assert arm["lmode"] == "window" and arm["label"] == "synthetic-dsv-paperrule-local1.1.0-lmodewindow-S256"
    with pytest.raises(ValueError, match="lmode must be one of"):
        parse_arm("lmode=cube")


@pytest.mark.timeout(300)
def test_token_lists_arm_trains_into_stage_two(megatron_cpu, tmp_path):
    """gran=token reaches the DSV layers (token lists, no key blocks) and a short run with a stage-1 window (the
    frontier's tok_s1win_cap25_s400) profiles and switches stage with them."""
    from benchmarks.video_runs import train_arm
    from megatron_dsv.attention import dsv_layers
    from tests.test_benchmarks_smoke import _run_args

    model, _, summary = train_arm(parse_arm("data=synthetic,frames=4,res=64,stage1=3,steps=6,gran=token,"
                                            "s1local=0.1.1"), _run_args(tmp_path))
    layers = dsv_layers(model)
    assert layers and all(m.dsv_config.granularity == "token" and m.dsv_config.block_size == 0
                          and m.dsv_config.stage1_local_radius == (0, 1, 1) for m in layers)
    assert summary["steps"] == 6 and 0.0 < summary["budget_density"] <= 1.0 and summary["recall"] > 0.0
    assert all(m.stage_host == 2 for m in layers)


@pytest.mark.timeout(300)
def test_footage_arm_trains_and_validates_on_held_out_frames(megatron_cpu, tmp_path, monkeypatch):
    """data=footage trains on windows before the videos' held-out ends and validates inside them
    (a small written video stands in for the pinned ones: tests/data/test_footage.py)."""
    cv2 = pytest.importorskip("cv2", reason="opencv-python-headless not installed (pip install -e '.[video]')")
    import numpy as np

    from benchmarks.video_runs import Clips, train_arm
    from megatron_dsv.checksums import file_sha256
    from megatron_dsv.data import footage, rendered
    from tests.test_benchmarks_smoke import _run_args

    path = str(tmp_path / "v.avi")
    out = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 10, (96, 64))
    rng = np.random.default_rng(0)
    for _ in range(60):
        out.write(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8))
    out.release()
    monkeypatch.setenv("DSV_FOOTAGE_DIR", str(tmp_path))
    monkeypatch.setitem(footage.FOOTAGE, "v", footage.FootageFile("pypi", "none", "v.avi", file_sha256(path), 60))
    monkeypatch.setitem(rendered.SOURCES, "footage", ("v",))
    calls = []
    real = rendered.render_clip
    monkeypatch.setattr(rendered, "render_clip", lambda *a, **k: calls.append((a[1], k["holdout"])) or real(*a, **k))
    Clips._cache.clear()
    arm = parse_arm("data=footage,frames=4,res=64,stage1=2,steps=4")
    assert arm["label"] == "footage-dsv-S256"
    _, _, summary = train_arm(arm, _run_args(tmp_path))
    assert summary["steps"] == 4 and np.isfinite(summary["val_loss"])
    assert sorted(set(calls)) == [(0, False), (1, False), (2, False), (3, True)]  # 3 training clips, 1 held out


@pytest.mark.timeout(300)
def test_align_stops_save_where_they_stop_report_the_last_validation_and_resume_exactly(megatron_cpu, tmp_path):
    """--align-stops: a run stopped by its minutes is saved where it stopped (no step is trained twice), reports
    its last validation step, and resumes to the same curve and weights as an uninterrupted run; seeds change
    the data order and the initial weights, not the clips."""
    import torch

    from benchmarks.video_runs import Clips, train_arm
    from tests.test_benchmarks_smoke import _run_args

    arm = "data=synthetic,frames=4,res=64,stage1=3,steps=8"
    curves, parts = {"straight": [], "cut": []}, []
    straight = train_arm(parse_arm(arm), _run_args(tmp_path, "--val-every", "2"),
                         on_val=lambda s, v, c, b: (curves["straight"].append((s, v)), parts.append((v, b))))
    for loss, b in parts:  # the breakdown: its means per timestep and per class are the loss's parts
        assert len(b["by_t"]) == 5 and sum(b["by_t"]) / 5 == pytest.approx(loss, rel=1e-5)
        assert b["by_class"] and set(b["by_class"]) <= {str(c) for c in range(8)}
    args = _run_args(tmp_path, "--val-every", "2", "--save-dir", str(tmp_path / "runs"), "--align-stops")
    cut = train_arm(parse_arm(arm + ",minutes=0.0000001"), args, on_val=lambda s, v, c, b: curves["cut"].append((s, v)))
    run = tmp_path / "runs" / "synthetic-dsv-S256.pt"
    assert cut[2]["steps"] == 0 and run.exists()  # stopped after step 1, before any validation: saved at step 1
    assert torch.load(run, map_location="cpu", weights_only=True)["step"] == 1
    args.val_every = 1
    cut = train_arm(parse_arm(arm + ",minutes=0.0000001"), args, on_val=lambda s, v, c, b: curves["cut"].append((s, v)))
    assert cut[2]["steps"] == 2 and curves["cut"] == [(2, cut[2]["val_loss"])]  # resumed at 1, validated at 2
    args.val_every = 4
    again = train_arm(parse_arm(arm + ",minutes=0.0000001"), args, on_val=lambda s, v, c, b: curves["cut"].append((s, v)))
    assert again[2]["steps"] == 2 and again[2]["val_loss"] == cut[2]["val_loss"]  # stopped at 3: reports step 2
    assert torch.load(run, map_location="cpu", weights_only=True)["step"] == 3
    args.val_every = 2
    resumed = train_arm(parse_arm(arm), args, on_val=lambda s, v, c, b: curves["cut"].append((s, v)))
    assert resumed[2]["steps"] == 8 and [s for s, _ in curves["cut"]] == [2, 4, 6, 8]  # resumed at 3
    assert dict(curves["cut"])[8] == dict(curves["straight"])[8] == straight[2]["val_loss"]
    assert dict(curves["cut"])[2] == dict(curves["straight"])[2]
    a, b = straight[0].state_dict(), resumed[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))
    clips0 = Clips.for_arm(parse_arm(arm), _run_args(tmp_path, "--data-seed", "0"), 4, torch.device("cpu"),
                           torch.float32)
    first0 = clips0.batch_at(0, 3)[0].clone()
    clips1 = Clips.for_arm(parse_arm(arm), _run_args(tmp_path, "--data-seed", "0", "--seed", "1"), 4,
                           torch.device("cpu"), torch.float32)
    assert clips1 is clips0 and not torch.equal(clips1.batch_at(0, 3)[0], first0)  # same clips, other order
    assert sorted(clips1._epoch_order(0).tolist()) == [0, 1, 2]
    # --order-seed fixes the clip order apart from the seed: seed 1 with order 0 trains in seed 0's order, and seed
    # 0 with order 1 in seed 1's (epochs 0-2: each epoch its own permutation)
    def orders(*extra):
        clips = Clips.for_arm(parse_arm(arm), _run_args(tmp_path, "--data-seed", "0", *extra), 4, torch.device("cpu"),
                              torch.float32)
        return [clips._epoch_order(e).tolist() for e in range(3)]

    assert orders("--seed", "1", "--order-seed", "0") == orders() == [[0, 1, 2]] * 3
    assert orders("--order-seed", "1") == orders("--seed", "1") == orders("--seed", "5", "--order-seed", "1")
    assert orders("--seed", "1") != orders()


def test_s1local_key_reaches_the_config_and_the_label():
    """s1local (DSVConfig.stage1_local_radius): 0.0.0 (a dense stage 1) by default and absent from the label (runs
    saved before the key keep their paths); a radius, or 'auto' (the library's default), is named in it; malformed
    radii are refused."""
    base = parse_arm("data=synthetic,frames=4,res=64")
    assert base["stage1_local_radius"] == (0, 0, 0) and "s1local" not in base["label"]
    arm = parse_arm("data=synthetic,frames=4,res=64,s1local=2.2.1")
    assert arm["stage1_local_radius"] == (2, 2, 1) and arm["label"] == "synthetic-dsv-s1local2.2.1-S256"
    auto = parse_arm("data=synthetic,frames=4,res=64,s1local=auto")
    assert auto["stage1_local_radius"] is None and auto["label"] == "synthetic-dsv-s1localauto-S256"
    for bad in ("1.1", "a.b.c"):
        with pytest.raises(ValueError, match="arm s1local must be three ints"):
            parse_arm(f"s1local={bad}")


@pytest.mark.timeout(300)
def test_windowed_stage1_arm_trains_into_stage_two(megatron_cpu, tmp_path):
    """s1local reaches every DSV layer; stage 1 then attends the window (kept keys below S) and the run still
    profiles, switches and runs its predicted lists in stage 2."""
    from benchmarks.video_runs import train_arm
    from megatron_dsv.attention import dsv_layers
    from tests.test_benchmarks_smoke import _run_args

    model, _, summary = train_arm(parse_arm("data=synthetic,frames=4,res=128,stage1=3,steps=6,rule=sparsity,"
                                            "thr=0,s1local=0.1.1"), _run_args(tmp_path))
    layers = dsv_layers(model)
    assert layers and all(m.dsv_config.stage1_local_radius == (0, 1, 1) for m in layers)
    assert summary["steps"] == 6 and all(m.stage_host == 2 for m in layers)
    for m in layers:  # the stage-1 window attends fewer keys than S on this grid (1024 tokens, 4x4x8 cubes: 1x4x2)
        m.stage.fill_(1)
        m._sync_host()
        assert m._stage1_window(1024, "cpu")[2] < 1024


def test_lr_cooldown_schedule_warms_up_holds_decays_and_stays_at_its_floor():
    """--lr-cooldown f: linear warm-up, constant, a linear decay over the last f of the schedule's steps to
    --lr-min-frac, extra steps past the schedule at that floor; f = 0 is the constant rate of runs 1-12."""
    import argparse

    from benchmarks.video_runs import lr_scale, lr_schedule, schedule_key

    args = argparse.Namespace(warmup=10, lr_cooldown=0.2, lr_min_frac=0.1)
    assert lr_schedule(args, 100) == dict(warmup=10, decay_start=80, decay_end=100, min_frac=0.1)
    scale = [lr_scale(s, lr_schedule(args, 100)) for s in range(110)]
    assert scale[0] == pytest.approx(0.1) and scale[9] == 1.0  # warm-up: (step + 1) / 10
    assert all(x == 1.0 for x in scale[9:80])
    assert scale[89] == pytest.approx(1.0 - 0.9 * 0.5) and scale[99] == pytest.approx(0.1)  # halfway, end
    assert all(a > b for a, b in zip(scale[79:100], scale[80:100]))  # strictly decreasing through the cooldown
    assert all(x == pytest.approx(0.1) for x in scale[100:])  # extra steps: the floor
    constant = argparse.Namespace(warmup=10, lr_cooldown=0.0, lr_min_frac=0.0)
    assert [lr_scale(s, lr_schedule(constant, 100)) for s in range(9, 120)] == [1.0] * 111
    assert schedule_key(lr_schedule(constant, 100)) == schedule_key(None) == "constant"
    assert schedule_key(lr_schedule(args, 100)) != schedule_key(lr_schedule(args, 200))
    with pytest.raises(ValueError, match="--lr-cooldown must be a fraction"):
        lr_schedule(argparse.Namespace(warmup=10, lr_cooldown=1.5, lr_min_frac=0.0), 100)
    with pytest.raises(ValueError, match="--lr-min-frac must be in"):
        lr_schedule(argparse.Namespace(warmup=10, lr_cooldown=0.2, lr_min_frac=-1.0), 100)
    with pytest.raises(ValueError, match="inside the 10-step warm-up"):
        lr_schedule(argparse.Namespace(warmup=10, lr_cooldown=0.95, lr_min_frac=0.0), 100)


@pytest.mark.timeout(300)
def test_a_run_resumes_only_on_the_schedule_it_was_trained_on(megatron_cpu, tmp_path):
    """The run checkpoint keeps its learning-rate schedule: resuming it under another cooldown is refused, naming
    both; under its own it trains on to the same weights as a run never stopped."""
    import torch

    from benchmarks.video_runs import train_arm
    from tests.test_benchmarks_smoke import _run_args

    arm = "data=synthetic,frames=4,res=64,stage1=3,steps=6,attn=full"
    straight = train_arm(parse_arm(arm), _run_args(tmp_path, "--warmup", "1", "--lr-cooldown", "0.5"))
    args = _run_args(tmp_path, "--warmup", "1", "--lr-cooldown", "0.5", "--save-dir", str(tmp_path / "runs"))
    train_arm(parse_arm(arm.replace("steps=6", "steps=4")), args)
    args.schedule_steps = 6  # the study's steps fix the schedule (bench_quality sets them)
    with pytest.raises(ValueError, match="another learning-rate schedule"):
        train_arm(parse_arm(arm), args)  # saved with the 4-step schedule, now the 6-step one
    wrong = _run_args(tmp_path, "--warmup", "1", "--save-dir", str(tmp_path / "runs2"))
    wrong.schedule_steps = 6
    train_arm(parse_arm(arm.replace("steps=6", "steps=4")), wrong)
    wrong.lr_cooldown = 0.5
    with pytest.raises(ValueError, match="constant"):
        train_arm(parse_arm(arm), wrong)
    good = _run_args(tmp_path, "--warmup", "1", "--lr-cooldown", "0.5", "--save-dir", str(tmp_path / "runs3"))
    good.schedule_steps = 6
    train_arm(parse_arm(arm.replace("steps=6", "steps=4")), good)
    resumed = train_arm(parse_arm(arm), good)
    a, b = straight[0].state_dict(), resumed[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))


@pytest.mark.timeout(300)
def test_a_run_resumes_only_at_its_batch_and_a_fixed_init_is_shared_by_seeds(megatron_cpu, tmp_path):
    """The run checkpoint keeps its batch, fixed init and fixed clip order: resuming at another --batch,
    --init-seed or --order-seed is refused, naming both, at its own it trains on. --init-seed: two
    seeds start from the same weights (seed 3's own draw differs), so a study can vary the data order and noise
    alone."""
    import torch

    from benchmarks.video_runs import build_model, train_arm
    from tests.test_benchmarks_smoke import _run_args

    arm = "data=synthetic,frames=4,res=64,stage1=3,steps=4,attn=full"
    args = _run_args(tmp_path, "--batch", "2", "--save-dir", str(tmp_path / "runs"))
    train_arm(parse_arm(arm.replace("steps=4", "steps=2")), args)
    args.batch = 1
    with pytest.raises(ValueError, match="--batch 2, not 1"):
        train_arm(parse_arm(arm), args)
    args.batch, args.init_seed = 2, 7
    with pytest.raises(ValueError, match="--init-seed None, not 7"):  # saved from the seed's own weights
        train_arm(parse_arm(arm), args)
    args.init_seed, args.order_seed = None, 0
    with pytest.raises(ValueError, match="--order-seed None, not 0"):  # saved in the seed's own clip order
        train_arm(parse_arm(arm), args)
    args.order_seed = None
    assert train_arm(parse_arm(arm), args)[2]["steps"] == 4  # its own harness: resumed to the end
    saved = torch.load(tmp_path / "runs" / f"{parse_arm(arm)['label']}.pt", map_location="cpu", weights_only=True)
    assert (saved["batch"], saved["init_seed"], saved["order_seed"]) == (2, None, None)

    def weights(*extra):
        model, _ = build_model(parse_arm(arm), _run_args(tmp_path, *extra), torch.device("cpu"), torch.float32)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    fixed = weights("--seed", "3", "--init-seed", "1")
    assert torch.equal(fixed, weights("--seed", "5", "--init-seed", "1"))
    assert torch.equal(fixed, weights("--seed", "1"))
    assert not torch.equal(fixed, weights("--seed", "3"))


def test_val_breakdown_means_per_class_and_timestep():
    """val_breakdown: each class's mean over its own held-out clips (by name), each timestep's over all clips."""
    import torch

    from benchmarks.video_runs import val_breakdown

    parts = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [3.0, 4.0, 5.0, 6.0, 7.0], [10.0] * 5])
    b = val_breakdown(parts, torch.tensor([2, 2, 0]), ["vtest", "box", "cup"])
    assert b["by_class"] == {"vtest": 10.0, "cup": 4.0}
    assert b["by_t"] == pytest.approx([14 / 3, 16 / 3, 18 / 3, 20 / 3, 22 / 3])


def test_training_seconds_are_counted_and_marked_shared_beside_another_worker(tmp_path):
    """Every validation gets the run's training seconds so far (validations left out); seconds trained while another
    frontier worker ran on the machine are counted as shared too, so a report can tell which seeds ran alone."""
    import subprocess
    import time

    from benchmarks.frontier_launch import running_workers
    from benchmarks.video_runs import train_arm
    from tests.test_benchmarks_smoke import _run_args

    arm = "data=synthetic,frames=4,res=64,stage1=3,steps=5"

    def counters_at_validations():
        seen = []
        train_arm(parse_arm(arm), _run_args(tmp_path, "--val-every", "2"),
                  on_val=lambda s, v, c, b: seen.append((s, dict(c))))
        return seen

    alone = counters_at_validations()
    assert [s for s, _ in alone] == [2, 4, 5]  # the last step validates too: its seconds are in
    seconds = [c["train_s"] for _, c in alone]
    assert 0 < seconds[0] < seconds[1] < seconds[2] and all(c["shared_s"] == 0 for _, c in alone)
    fake = tmp_path / "bench_quality.py"  # a process whose command line looks like a worker's
    fake.write_text("import time\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(fake), "--worker", "full", "--seed", "0"])
    try:
        for _ in range(100):
            if running_workers() > 0:
                break
            time.sleep(0.1)
        shared = counters_at_validations()
    finally:
        proc.kill()
        proc.wait()
    assert all(c["shared_s"] == c["train_s"] > 0 for _, c in shared)
    # stopped by its minutes after step 1, between validations: the step's seconds are saved with it
    import torch

    args = _run_args(tmp_path, "--val-every", "4", "--save-dir", str(tmp_path / "runs"), "--align-stops")
    train_arm(parse_arm(arm + ",minutes=0.0000001"), args, on_val=lambda s, v, c, b: None)
    saved = torch.load(next((tmp_path / "runs").glob("*.pt")), map_location="cpu", weights_only=True)
    assert saved["step"] == 1 and saved["counters"]["train_s"] > 0


def test_group_key_reaches_the_config_and_the_label():
    """group (DSVConfig.query_group_shape t.h.w): 4.4.8 by default and absent from the label (runs saved before the
    key keep their paths); another cube is named in it and reaches the DSV config; a cube of an unsupported size
    or a malformed one is refused naming the key."""
    from benchmarks.bench_quality import FRONTIER
    from benchmarks.quality_report import is_library_default

    base = parse_arm("data=synthetic,frames=4,res=64")
    assert base["query_group_shape"] == (4, 4, 8) and "group" not in base["label"]
    arm = parse_arm("data=synthetic,frames=4,res=64,group=2.4.4")
    assert arm["query_group_shape"] == (2, 4, 4) and arm["label"] == "synthetic-dsv-group2.4.4-S256"
    with pytest.raises(ValueError, match=r"arm group .* must hold one of \(16, 32, 64, 128\) tokens"):
        parse_arm("group=3.3.3")
    with pytest.raises(ValueError, match="arm group must be three ints"):
        parse_arm("group=4.4")
    study = "data=vizdoom,frames=16,res=256"
    g64 = parse_arm(f"{study},{FRONTIER['g64_s1win_cap25_s400']}")
    assert g64["query_group_shape"] == (2, 4, 8) and g64["stage1_local_radius"] == (4, 2, 1)
    default = parse_arm(f"{study},{FRONTIER['default']}")
    assert not is_library_default(g64) and is_library_default(default)
    assert not is_library_default(dict(default, query_group_shape=(2, 4, 8)))  # the cube alone decides it


@pytest.mark.timeout(300)
def test_small_group_arm_trains_into_stage_two(megatron_cpu, tmp_path):
    """The frontier's G = 32 cube (with its stage-1 window) trains through both stages: the cube reaches every
    layer and stage 2 runs."""
    from benchmarks.video_runs import train_arm
    from megatron_dsv.attention import dsv_layers
    from tests.test_benchmarks_smoke import _run_args

    arm = parse_arm("data=synthetic,frames=4,res=64,stage1=3,steps=6,rule=sparsity,thr=0,cap=0.25,group=2.4.4,"
                    "s1local=0.2.2")
    model, _, summary = train_arm(arm, _run_args(tmp_path))
    layers = dsv_layers(model)
    assert layers and all(m.dsv_config.query_group_shape == (2, 4, 4) for m in layers)
    assert summary["steps"] == 6 and all(m.stage_host == 2 for m in layers)
