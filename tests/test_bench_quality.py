"""The quality frontier's arithmetic: equal-step comparison, paired deltas over seeds, wall-clock from
measured step times, the time to reach full attention's loss."""

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import frontier_launch  # noqa: E402
from benchmarks.bench_quality import FRONTIER, arm_of, build_parser, profile_period  # noqa: E402
from benchmarks.quality_report import (_sparse_share_at, cut_records, equal_step, is_library_default,  # noqa: E402
                                       mean_se, time_to_reach, unpaired_delta, wall_clock)
from benchmarks.frontier_launch import died_of_oom, launch, running_workers, wait_for_slot  # noqa: E402
from megatron_dsv.config import DSVConfig  # noqa: E402

# starts, counts (frontier_launch.running_workers) or stops processes by name: in tests/conftest.py's PROCESS_FILES


def _rec(curve):
    return {"curve": curve}


def test_equal_step_is_the_last_step_every_run_reached():
    # a DSV seed stopped at 1692 by its minutes budget: its last value is never set against 2000-step runs
    records = {"full": {0: _rec([(250, 1.4), (1500, 1.03), (2000, 0.955)]), 1: _rec([(250, 1.5), (1500, 1.0)])},
               "dsv": {0: _rec([(250, 1.5), (1500, 1.015), (1692, 0.978)])}}
    assert equal_step(records) == 1500
    with pytest.raises(ValueError, match="minutes"):
        equal_step({"full": {0: _rec([(250, 1.0)])}, "dsv": {0: _rec([(100, 1.1)])}})


def test_mean_se_and_time_to_reach():
    mean, se = mean_se([1.0, 3.0])
    assert mean == 2.0 and se == pytest.approx(1.0)  # std 1.414 / sqrt(2)
    assert math.isnan(mean_se([2.0])[1])
    pts = [(10.0, 2.0), (20.0, 1.0), (30.0, 0.5)]
    assert time_to_reach(pts, 1.5) == pytest.approx(15.0)  # linear between validation points
    assert time_to_reach(pts, 2.5) == 10.0 and time_to_reach(pts, 0.4) is None


def test_unpaired_delta_is_the_ratio_of_means_with_the_delta_method_se():
    # arm mean 0.99 (se 0.01), full mean 1.0 (se 0.02): -1%, se 100 * sqrt(0.01^2 + 0.99^2 0.02^2) = 2.23%
    delta, se = unpaired_delta([0.98, 1.00], [0.98, 1.02])
    assert delta == pytest.approx(-1.0) and se == pytest.approx(100 * math.sqrt(0.01 ** 2 + 0.99 ** 2 * 0.02 ** 2))
    # run 10's footage split: paired the seeds disagree by 11 points; unpaired the means are 0.6% apart
    delta, se = unpaired_delta([0.5661, 0.6003], [0.5904, 0.5623, 0.6071, 0.5869])
    assert delta == pytest.approx(100 * (0.5832 / 0.586675 - 1), abs=1e-3) and 2.5 < se < 3.5
    assert math.isnan(unpaired_delta([1.0], [1.0, 1.1])[1])  # one arm seed: no se


def test_wall_clock_charges_stage_one_and_two_at_their_own_times():
    arm = {"attn": "dsv", "stage1": 100}
    wc = wall_clock([(50, 2.0), (300, 1.0)], arm, {"stage1": 10.0, "stage2": 4.0})
    assert wc == [(0.5, 2.0), (pytest.approx(1.8), 1.0)]  # 100 x 10 ms + 200 x 4 ms
    assert wall_clock([(50, 2.0)], {"attn": "full"}, {"stage1": 8.0, "stage2": 8.0}) == [(0.4, 2.0)]
    assert wall_clock([(50, 2.0)], arm, None) is None


def test_wall_clock_charges_stage_two_by_the_share_of_layers_that_ran_sparse():
    """A stage-2 step whose layers ran dense costs the dense time: each interval between validations is charged
    by its own share of sparse layer-steps (cumulative counts), else by the run's overall share."""
    arm, t = {"attn": "dsv", "stage1": 100}, {"stage1": 10.0, "stage2": 4.0}
    # 4 layers; steps 100-200 all dense (0 of 400 layer-steps), 200-300 half sparse (200 of 400)
    counts = {100: (0, 0), 200: (0, 400), 300: (200, 800)}
    wc = wall_clock([(100, 3.0), (200, 2.0), (300, 1.0)], arm, t, counts=counts)
    assert [x for x, _ in wc] == [pytest.approx(1.0), pytest.approx(2.0), pytest.approx(2.7)]  # 100 x (10 - 0.5 x 6)
    # no counts: the overall share (here 0.25) for every stage-2 step
    wc = wall_clock([(300, 1.0)], arm, t, sparse_share=0.25)
    assert wc[0][0] == pytest.approx(1.0 + 200 * (10 - 0.25 * 6) / 1e3)
    # a validation inside stage 1, then one past it: only the steps past stage 1 take the stage-2 share
    wc = wall_clock([(50, 2.0), (150, 1.5)], arm, t, counts={50: (0, 0), 150: (200, 200)})
    assert wc[1][0] == pytest.approx(1.0 + 50 * 4.0 / 1e3)
    # the stage-2 time was clocked with half the layers sparse (the trained decisions kept the others dense): an
    # interval with a quarter of its layer-steps sparse costs 10 - (0.25 / 0.5) x 6 = 7 ms a step
    half = dict(t, stage2_sparse_share=0.5)
    wc = wall_clock([(100, 2.0), (200, 1.0)], arm, half, counts={100: (0, 0), 200: (100, 400)})
    assert wc[1][0] == pytest.approx(1.0 + 100 * 7.0 / 1e3)
    # nothing sparse when clocked: no sparse layer's cost is known, every stage-2 step is charged dense
    wc = wall_clock([(200, 1.0)], arm, dict(t, stage2=10.0, stage2_sparse_share=0.0), sparse_share=0.9)
    assert wc[0][0] == pytest.approx(2.0)


def test_two_arm_names_for_one_run_are_refused(monkeypatch):
    """Two names for one design (as run 5's default_s400 was cap25_s400 while the default stage 1 was dense): one
    run path, two workers."""
    from benchmarks.bench_quality import check_distinct_runs

    args = build_parser().parse_args(["--arm", "data=vizdoom,frames=16,res=256,steps=1500", "--save-dir", "x"])
    check_distinct_runs(["full", "cap25_s400", "s1win_cap25_s400", "window"], args)
    monkeypatch.setitem(FRONTIER, "cap25_again", FRONTIER["cap25_s400"])
    with pytest.raises(SystemExit, match="'cap25_s400' and 'cap25_again' are the same run"):
        check_distinct_runs(["full", "cap25_s400", "cap25_again"], args)


def test_frontier_arms_parse_with_their_settings():
    args = build_parser().parse_args(["--arm", "data=synthetic,frames=4,res=64,steps=100", "--save-dir", "x"])
    for name in FRONTIER:
        arm_of(name, args.arm, args)
    assert arm_of("control", args.arm, args)["stage1"] >= 100  # never leaves stage 1
    local = arm_of("local", args.arm, args)
    assert local["local_radius"] == (0, 1, 1) and local["rule"] == "sparsity"
    assert arm_of("window", args.arm, args)["window_frac"] == 0.2
    with pytest.raises(ValueError, match="unknown frontier arm"):
        arm_of("nope", args.arm, args)
    assert arm_of("local111_thr07", args.arm, args)["thr"] == 0.7
    wp = arm_of("windowpred35_s400", args.arm, args)
    assert wp["lmode"] == "window" and wp["local_radius"] == (2, 2, 1) and wp["cap"] == 0.35 and wp["stage1"] == 400
    assert not is_library_default(wp)
    # the default since run 11 where the window applies (16K tokens: 29% of the keys); on 256 tokens the (2, 2, 1)
    # window is every key, so the default's stage 1 is dense there and an explicit window is not the default
    s1 = arm_of("s1win_cap25_s400", args.arm, args)
    assert s1["stage1_local_radius"] == (2, 2, 1) and s1["cap"] == 0.25 and not is_library_default(s1)
    s1_16k = arm_of("s1win_cap25_s400", "data=vizdoom,frames=16,res=256,steps=1500", args)
    assert is_library_default(s1_16k) and is_library_default(arm_of("default", "data=vizdoom,frames=16,res=256", args))
    assert not is_library_default(arm_of("cap25_s400", "data=vizdoom,frames=16,res=256,steps=1500", args))
    assert arm_of("s1win_windowpred35_s400", args.arm, args)["lmode"] == "window"
    study = "data=synthetic,frames=4,res=64,steps=1500,stage1=700"
    own, base = arm_of("default", study, args), arm_of("paper", study, args)
    # the default switches where the library does (DSVConfig.stage_switch_steps), whatever the study's stage1
    assert own["stage1"] == DSVConfig().stage_switch_steps == 400 and base["stage1"] == 700
    assert arm_of("uncapped_s400", study, args)["cap"] == 0 and own["cap"] == 0.25
    args.extra_steps = 20  # every arm but full trains 20% longer
    assert arm_of("full", args.arm, args)["steps"] == 100 and arm_of("default", args.arm, args)["steps"] == 120


def test_library_default_marks_the_arms_whose_lists_are_the_defaults():
    # 16K ViZDoom grid (16, 32, 32): the 4x4x8 cube tiles it, so the auto neighbourhood is (1, 1, 1)
    args = build_parser().parse_args(["--arm", "data=vizdoom,frames=16,res=256", "--save-dir", "x"])
    marked = {name for name in FRONTIER if is_library_default(arm_of(name, args.arm, args))}
    # local111 keeps the old threshold (0.8); the library caps every list at 25% of the keys (DSVConfig.max_density),
    # on this grid attends the (2, 2, 1) window in stage 1 (DSVConfig.stage1_local_radius auto) and switches at step
    # 400: s1win_cap25_s400 (runs 10-22) is the default; cap25_s400 (run 6, dense stage 1) and the uncapped
    # designs of runs 2-5 are not
    assert marked == {"default", "s1win_cap25_s400"}
    # a switch at another step is not the default, whatever the lists
    assert not is_library_default(dict(arm_of("default", args.arm, args), stage1=700))


def test_profile_period_is_the_schedules_at_the_runs_step():
    """--time clocks whole profile periods: the period in effect where the trained run stands (a run past the
    profiler's warm-up profiles every profile_interval_after_warmup steps, not every profile_interval)."""
    from megatron_dsv.attention.schedule import is_profile_step
    from megatron_dsv.config import DSVConfig

    cfg = DSVConfig(profile_interval=25, profile_interval_after_warmup=100, profile_warmup_steps=1000)
    for step in (0, 700, 999, 1000, 1750, 5000):
        period = profile_period(cfg, step)
        window = [s for s in range(step, step + 4 * period) if is_profile_step(s, cfg)]
        assert period == (25 if step < 1000 else 100)
        if step + 4 * period <= 1000 or step >= 1000:  # a window inside one phase holds one profile a period
            assert len(window) == 4, (step, window)


def test_cut_records_reports_a_longer_study_at_a_shorter_step():
    records = {"full": {0: {"curve": [(250, 1.4), (500, 1.1), (750, 1.0)], "sparse_counts": {}}},
               "dsv": {0: {"curve": [(250, 1.5), (500, 1.2), (750, 0.9)],
                           "sparse_counts": {250: (0, 0), 500: (6, 8), 750: (14, 16)}}}}
    cut = cut_records(records, 500)
    assert equal_step(cut) == 500 and cut["dsv"][0]["curve"] == [(250, 1.5), (500, 1.2)]
    assert cut["dsv"][0]["sparse_counts"] == {250: (0, 0), 500: (6, 8)}
    assert records["dsv"][0]["curve"][-1] == (750, 0.9)  # the records themselves are left whole
    # the sparse share up to the cut comes from the counts; without stage-2 layer-steps, from the summaries
    assert _sparse_share_at(cut["dsv"].values(), 500, [{"sparse_layer_fraction": 0.9}]) == 0.75
    assert _sparse_share_at(cut["dsv"].values(), 250, [{"sparse_layer_fraction": 0.9}]) == 0.9
    with pytest.raises(ValueError, match="--at-step 600: run full seed 0 has no validation there"):
        cut_records(records, 600)


def test_report_reads_only_the_seeds_asked_for(tmp_path):
    """--seeds with --report keeps those seeds' curves (a save-dir joined from two sessions holds runs of other
    lengths); without --seeds every curve under --save-dir is read."""
    import json
    from types import SimpleNamespace

    from benchmarks.quality_report import load_records

    (tmp_path / "curves").mkdir()
    for name in ("full", "dsv"):
        for seed, last in ((4, 3000), (5, 2750), (7, 3000)):
            curve = [[s, 1.0 - s / 1e4] for s in range(250, last + 1, 250)]
            (tmp_path / "curves" / f"{name}-s{seed}.json").write_text(json.dumps(
                {"name": name, "seed": seed, "curve": curve, "sparse_counts": {}}))
    every = load_records(SimpleNamespace(save_dir=str(tmp_path), at_step=None, seeds=None))
    assert sorted(every["dsv"]) == [4, 5, 7]
    with pytest.raises(ValueError, match="seed 5 has no validation there"):
        load_records(SimpleNamespace(save_dir=str(tmp_path), at_step=3000, seeds=None))
    asked = load_records(SimpleNamespace(save_dir=str(tmp_path), at_step=3000, seeds="4,7"))
    assert sorted(asked["full"]) == sorted(asked["dsv"]) == [4, 7]
    assert asked["dsv"][7]["curve"][-1] == (3000, 0.7)


def test_worker_slots_count_every_launchers_workers(tmp_path):
    """The cap counts worker processes machine-wide (another study's launcher shares the GPU)."""
    import subprocess

    fake = tmp_path / "bench_quality.py"  # a process whose command line looks like a worker's
    fake.write_text("import time\ntime.sleep(30)\n")
    before = running_workers()
    proc = subprocess.Popen([sys.executable, str(fake), "--worker", "full", "--seed", "0"])
    try:
        import time as _time

        for _ in range(50):  # /proc shows the command line once the interpreter has started
            if running_workers() == before + 1:
                break
            _time.sleep(0.1)
        assert running_workers() == before + 1
        wait_for_slot(before + 2, poll_s=0.01)  # a free slot: returns at once
        wait_for_slot(0)  # no cap
    finally:
        proc.kill()
        proc.wait()
    wait_for_slot(before + 1, poll_s=0.05)  # the worker ended: its slot is free again


def test_a_worker_that_ran_out_of_gpu_memory_is_resumed_and_other_failures_are_reported(tmp_path, monkeypatch):
    """run 7 lost two of ten workers to CUDA OOM: the launcher starts such a worker again (it resumes from its last
    save), at most --oom-retries times; a worker failing otherwise is not retried and fails the launch."""
    import subprocess

    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    # per (arm, seed): what each successive start prints and its exit code
    script = {("full", 0): [(oom, 1), ("done\n", 0)], ("cap", 0): [(oom, 1)] * 5,
              ("win", 0): [("ValueError: bad arm\n", 1)],
              ("late", 0): [(oom, 1), ("ValueError: a bug after the resume\n", 1)]}  # an old OOM in its log
    starts, real_popen = [], subprocess.Popen

    def fake_popen(cmd, stdout, stderr, env):
        key = (cmd[cmd.index("--worker") + 1], int(cmd[cmd.index("--seed") + 1]))
        text, code = script[key][sum(k == key for k in starts)]
        starts.append(key)
        assert env["PYTORCH_CUDA_ALLOC_CONF"]
        stdout.write(text)
        stdout.flush()
        return real_popen([sys.executable, "-c", f"raise SystemExit({code})"])

    monkeypatch.setattr(frontier_launch.subprocess, "Popen", fake_popen)
    args = build_parser().parse_args(["--arm", "data=vizdoom", "--save-dir", str(tmp_path), "--stagger", "0",
                                      "--oom-retries", "2"])
    with pytest.raises(SystemExit) as err:
        launch(["full", "cap", "win", "late"], [0], [], args)
    assert starts.count(("full", 0)) == 2  # resumed once, then finished
    assert starts.count(("cap", 0)) == 3  # the first start and two retries
    assert starts.count(("win", 0)) == 1  # not an OOM: not retried
    assert starts.count(("late", 0)) == 2  # its second failure is no OOM, whatever the log held before
    assert "cap-s0" in str(err.value) and "win-s0" in str(err.value) and "full-s0" not in str(err.value)
    assert "late-s0" in str(err.value)
    assert died_of_oom(str(tmp_path / "logs" / "cap-s0.log"))
    assert not died_of_oom(str(tmp_path / "logs" / "win-s0.log"))
    assert not died_of_oom(str(tmp_path / "logs" / "missing.log"))


def test_workers_start_seed_by_seed(tmp_path, monkeypatch):
    """A study cut short by the device time keeps whole (full, DSV) pairs: the launcher starts every arm of a seed
    before the next seed (arm by arm, a study cut short would leave the last arm's seeds unfinished, unpaired)."""
    import subprocess

    starts, real_popen = [], subprocess.Popen

    def fake_popen(cmd, stdout, stderr, env):
        starts.append((cmd[cmd.index("--worker") + 1], int(cmd[cmd.index("--seed") + 1])))
        return real_popen([sys.executable, "-c", "pass"])

    monkeypatch.setattr(frontier_launch.subprocess, "Popen", fake_popen)
    args = build_parser().parse_args(["--arm", "data=vizdoom", "--save-dir", str(tmp_path), "--stagger", "0"])
    launch(["full", "dsv"], [0, 1, 2], [], args)
    assert starts == [("full", 0), ("dsv", 0), ("full", 1), ("dsv", 1), ("full", 2), ("dsv", 2)]


def test_timing_refuses_before_clocking_when_an_arm_has_no_trained_run(tmp_path):
    """--time checks every DSV arm's trained run first: run 7's timing clocked full attention for a minute of GPU
    time, then failed on an arm the study never trained. Full attention and the window need none: their steps do
    not depend on their weights."""
    from benchmarks.bench_quality import time_arms

    args = build_parser().parse_args(["--arm", "data=vizdoom,frames=2,res=64", "--save-dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"arms \['control', 'default'\] have no trained run of seed 0"):
        time_arms(["full", "control", "window", "default"], args)


def test_untrained_full_attention_is_timed_from_its_initial_weights(megatron_cpu, tmp_path, capsys):
    from benchmarks.bench_quality import time_arms

    args = build_parser().parse_args(["--arm", "data=synthetic,frames=2,res=64", "--save-dir", str(tmp_path),
                                      "--preset", "tiny", "--layers", "1", "--time-lengths", "",
                                      "--time-steps", "3", "--time-warmup", "1"])
    got = time_arms(["full"], args)
    assert got["full"]["128"]["stage2"] > 0 and got["full"]["128"]["stage2_sparse_share"] == 0.0
    assert "no trained run" in capsys.readouterr().out


def test_full_attention_is_required_only_where_it_is_the_baseline(tmp_path, monkeypatch):
    """A study may train new arms beside an existing full-attention run (--launch without 'full'); timing and
    reports refuse an arm list without it."""
    import benchmarks.bench_quality as bq

    base = ["--arm", "data=synthetic,frames=2,res=64", "--save-dir", str(tmp_path), "--arms", "s1win_cap25_s400"]
    for phase in ("--time", "--report"):
        with pytest.raises(SystemExit, match="must include 'full' with --time or --report"):
            bq.main(base + [phase])
    launched = []
    monkeypatch.setattr(bq, "prepare_clips", lambda args: None)
    monkeypatch.setattr(bq, "launch", lambda names, seeds, argv, args: launched.append((names, seeds)))
    bq.main(base + ["--launch", "--seeds", "0,1"])
    assert launched == [(["s1win_cap25_s400"], [0, 1])]


def test_the_report_refuses_runs_of_different_learning_rate_schedules():
    """A cooldown moves the final loss by more than the differences measured: a study mixing runs with and
    without one (or of two cooldowns) is refused, naming a run of each; curves without a schedule are constant."""
    from benchmarks.quality_report import check_one_schedule

    cool = dict(warmup=100, decay_start=2400, decay_end=3000, min_frac=0.0)
    constant = dict(warmup=100, decay_start=3000, decay_end=3000, min_frac=1.0)
    assert check_one_schedule({"full": {0: {}, 1: {"schedule": constant}}}) == {"constant": True}
    assert check_one_schedule({"full": {0: {"schedule": cool}}, "dsv": {0: {"schedule": dict(cool)}}}) == cool
    with pytest.raises(ValueError, match="different learning-rate schedules: full seed 0: constant.*dsv seed 0"):
        check_one_schedule({"full": {0: {}}, "dsv": {0: {"schedule": cool}}})
    with pytest.raises(ValueError, match="different learning-rate schedules"):
        check_one_schedule({"full": {0: {"schedule": cool}, 1: {"schedule": dict(cool, decay_start=2700)}}})


def test_the_report_refuses_runs_of_different_batches_or_initial_weights():
    """Batch, a fixed init and a fixed clip order are part of the harness: a study mixing them is refused, naming a
    run of each; a curve without them trained at batch 1 from its seed's own weights, in its own order (every study
    before run 31)."""
    from benchmarks.quality_report import check_one_harness, harness_of

    usual = dict(batch=1, init_seed=None, order_seed=None)
    assert harness_of({}) == usual
    assert check_one_harness({"full": {0: {}, 1: {"batch": 1}}, "dsv": {0: {"batch": 1, "init_seed": None}}}) == usual
    assert check_one_harness({"full": {0: {"batch": 4, "init_seed": 0}}}) == dict(batch=4, init_seed=0, order_seed=None)
    assert check_one_harness({"full": {0: {"batch": 4, "init_seed": 0, "order_seed": 0}}})["order_seed"] == 0
    with pytest.raises(ValueError, match="different harnesses"):
        check_one_harness({"full": {0: {"batch": 4, "init_seed": 0}, 1: {"batch": 4, "init_seed": 0, "order_seed": 1}}})
    with pytest.raises(ValueError, match=r"different harnesses: full seed 0: .*\"batch\": 1.*dsv seed 0"):
        check_one_harness({"full": {0: {}}, "dsv": {0: {"batch": 4}}})
    with pytest.raises(ValueError, match="different harnesses"):
        check_one_harness({"full": {0: {"batch": 4}, 1: {"batch": 4, "init_seed": 0}}})


def test_seeds_for_the_se_target_follow_the_paired_spread():
    """n = ceil((sd / 0.5)^2): run 10's ViZDoom deltas (sd 1.37%) need 8 seeds, run 11's 32K pair (-3.1, -4.5: sd 0.99%) 4."""
    from benchmarks.quality_report import seeds_for_se

    assert seeds_for_se([-0.29, -3.26, -0.44, -1.59]) == 8
    assert seeds_for_se([-3.1, -4.5]) == 4
    assert seeds_for_se([-1.0, -1.0, -1.0]) == 2  # no spread: the two any se needs
    assert seeds_for_se([-1.0]) is None
    assert seeds_for_se([0.0, 2.0], target=1.0) == 2  # sd 1.41: (1.41 / 1)^2 = 2


def test_harness_spread_reads_studies_and_refuses_mixed_schedules(tmp_path, capsys):
    """benchmarks/harness_spread.py: per study and step, full attention's seed sd and each arm's paired delta
    (mean, sd, seeds for the se target) over the seeds every run reached; a study mixing schedules is refused."""
    import json as _json

    from benchmarks import harness_spread

    def write(study, arm, seed, curve, schedule=None):
        d = tmp_path / study / "curves"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{arm}-s{seed}.json").write_text(_json.dumps(dict(name=arm, seed=seed, curve=curve, schedule=schedule)))

    for seed, (f, w) in enumerate([(1.00, 0.99), (1.10, 1.078), (0.90, 0.9)]):
        write("a", "full", seed, [[250, 2.0], [500, f]])
        write("a", "window", seed, [[250, 2.0], [500, w]] if seed < 2 else [[250, 2.0]])  # seed 2 stopped early
    rows = harness_spread.spread_rows("a", harness_spread.load_study(str(tmp_path / "a"))[0])
    full500 = next(r for r in rows if r["arm"] == "full" and r["step"] == 500)
    assert full500["seeds"] == [0, 1, 2] and full500["full_sd_pct"] == pytest.approx(10.0)
    win = [r for r in rows if r["arm"] == "window"]
    assert [r["step"] for r in win] == [250]  # 500: seed 2 never reached it, so no step every seed shares
    harness_spread.main(["--study", f"a={tmp_path / 'a'}", "--out", str(tmp_path / "out.json")])
    assert _json.load(open(tmp_path / "out.json"))["rows"][0]["study"] == "a"
    (tmp_path / "a" / "curves" / "window-s2.json").unlink()
    rows = harness_spread.spread_rows("a", harness_spread.load_study(str(tmp_path / "a"))[0])
    win500 = next(r for r in rows if r["arm"] == "window" and r["step"] == 500)
    assert win500["seeds"] == [0, 1] and win500["delta_pct"] == pytest.approx(-1.5)
    assert win500["delta_sd_pct"] == pytest.approx(math.sqrt(0.5), rel=1e-6) and win500["seeds_for_se_target"] == 2
    write("b", "full", 0, [[500, 1.0]], schedule=dict(warmup=1, decay_start=400, decay_end=500, min_frac=0.0))
    write("b", "full", 1, [[500, 1.0]])
    with pytest.raises(ValueError, match="different learning-rate schedules"):
        harness_spread.load_study(str(tmp_path / "b"))
    assert harness_spread.load_study(str(tmp_path / "a"))[3] == dict(batch=1, init_seed=None, order_seed=None)
    (tmp_path / "c" / "curves").mkdir(parents=True)
    for seed, batch in ((0, 1), (1, 4)):
        (tmp_path / "c" / "curves" / f"full-s{seed}.json").write_text(
            _json.dumps(dict(name="full", seed=seed, curve=[[500, 1.0]], batch=batch)))
    with pytest.raises(ValueError, match="different harnesses"):  # batch 1 and batch 4 are not one sample
        harness_spread.load_study(str(tmp_path / "c"))


def test_harness_spread_traces_the_paired_delta_to_classes_and_timesteps(tmp_path, capsys):
    """--by-class: at the last step both arms recorded a breakdown, the paired delta per class and per timestep."""
    import json as _json

    from benchmarks import harness_spread

    d = tmp_path / "s" / "curves"
    d.mkdir(parents=True)

    def bd(box, cup):
        return dict(by_class=dict(box=box, cup=cup), by_t=[box, cup, 1.0, 1.0, 1.0])

    runs = {("full", 0): {250: bd(1.0, 1.0), 500: bd(1.0, 2.0)}, ("full", 1): {500: bd(2.0, 1.0)},
            ("window", 0): {250: bd(1.0, 1.0), 500: bd(1.1, 2.0)}, ("window", 1): {500: bd(1.6, 1.0)}}
    for (arm, seed), parts in runs.items():
        (d / f"{arm}-s{seed}.json").write_text(_json.dumps(dict(
            name=arm, seed=seed, curve=[[s, 1.0] for s in parts], val_breakdown={str(k): v for k, v in parts.items()})))
    rows = harness_spread.class_rows("s", harness_spread.load_study(str(tmp_path / "s"))[2])
    by = {r["part"]: r for r in rows}
    assert set(by) == {"box", "cup", "t=0.1", "t=0.3", "t=0.5", "t=0.7", "t=0.9"}
    assert all(r["step"] == 500 and r["seeds"] == [0, 1] and r["arm"] == "window" for r in rows)
    assert by["box"]["delta_per_seed"] == pytest.approx({0: 10.0, 1: -20.0}) and by["box"]["delta_pct"] == pytest.approx(-5.0)
    assert by["cup"]["delta_pct"] == 0.0 and by["t=0.1"]["delta_pct"] == pytest.approx(-5.0)
    harness_spread.main(["--study", f"s={tmp_path / 's'}", "--by-class", "--out", str(tmp_path / "o.json"), "--plot"])
    assert "box" in capsys.readouterr().out
    kinds = [r.get("kind") for r in _json.load(open(tmp_path / "o.json"))["rows"]]
    assert kinds.count("by_class") == 7 and (tmp_path / "o.png").stat().st_size > 0


def test_join_seeds_pairs_within_each_file_and_counts_a_seed_once(tmp_path):
    """join_seeds reads each seed at the step from curve_per_seed (new reports) or val_loss_per_seed (rows compared
    at that step), pairs it with full attention of the same file, and refuses a seed found twice."""
    import json

    from benchmarks.join_seeds import join

    def write(name, rows, gpu):
        path = tmp_path / name
        path.write_text(json.dumps({"meta": {"gpu": gpu}, "rows": [dict(r, kind="arm") for r in rows]}))
        return str(path)

    old = write("old.json", [dict(name="full", steps=100, val_loss_per_seed={"0": 1.0, "1": 2.0}),
                             dict(name="dsv", steps=100, val_loss_per_seed={"0": 0.99, "1": 2.02})], "H200")
    new = write("new.json", [dict(name="full", curve_per_seed={"2": [[50, 3.0], [100, 1.5]], "3": [[50, 3.0]]}),
                             dict(name="dsv", curve_per_seed={"2": [[50, 2.9], [100, 1.47]], "3": [[50, 2.0]]})],
                "H100")
    got = join([old, new], "dsv", 100)
    assert got["seeds"] == [0, 1, 2]  # seed 3 never reached step 100
    assert [round(s["delta_pct"], 6) for s in got["per_seed"]] == [-1.0, 1.0, -2.0]
    assert [s["gpu"] for s in got["per_seed"]] == ["H200", "H200", "H100"]
    assert got["delta_vs_full_pct"] == pytest.approx(-2.0 / 3) and got["delta_vs_full_se_pct"] > 0
    assert join([new], "dsv", 50)["per_seed"][1]["delta_pct"] == pytest.approx(100 * (2.0 / 3.0 - 1))
    with pytest.raises(ValueError, match="seed 0 of 'dsv' is in"):
        join([old, old], "dsv", 100)
    with pytest.raises(ValueError, match="needs rows 'full' and 'window'"):
        join([old], "window", 100)
    with pytest.raises(ValueError, match="no seed of 'dsv'"):
        join([old], "dsv", 7)
    batch4 = write("b4.json", [dict(name="full", steps=100, batch=4, val_loss_per_seed={"5": 1.0}),
                               dict(name="dsv", steps=100, batch=4, val_loss_per_seed={"5": 0.9})], "H200")
    assert join([batch4], "dsv", 100)["seeds"] == [5]
    with pytest.raises(ValueError, match="different harnesses"):  # batch 1 and batch 4: not one sample of seeds
        join([old, batch4], "dsv", 100)


def test_the_report_charges_the_logged_seconds_of_the_seeds_that_trained_alone(tmp_path):
    """With no timing phase, the time to full attention's final loss comes from the runs' logged training seconds,
    only of seeds that ran alone on the GPU up to the reported step (a shared seed's steps are not step times)."""
    import json
    from types import SimpleNamespace

    from benchmarks.quality_report import report
    from benchmarks.video_runs import parse_arm

    (tmp_path / "curves").mkdir()
    base = "data=synthetic,frames=2,res=64,steps=3"
    runs = {  # name: (arm, {seed: (curve, [(train_s, shared_s)] per validation)})
        "full": (parse_arm(base + ",attn=full"), {
            0: ([1.0, 0.8, 0.6], [(10, 0), (20, 0), (30, 0)]),
            1: ([1.0, 0.8, 0.6], [(10, 0), (20, 0), (30, 0)])}),
        "dsv": (parse_arm(base + ",stage1=1"), {
            0: ([0.9, 0.6, 0.5], [(4, 0), (8, 0), (12, 0)]),
            1: ([0.9, 0.6, 0.5], [(40, 40), (80, 80), (120, 120)])}),  # shared: 10x slower, left out
    }
    for name, (arm, seeds) in runs.items():
        for seed, (losses, secs) in seeds.items():
            steps = [1, 2, 3]
            (tmp_path / "curves" / f"{name}-s{seed}.json").write_text(json.dumps(dict(
                name=name, seed=seed, arm=arm, curve=list(zip(steps, losses)),
                sparse_counts={str(s): [s, s] for s in steps},
                train_seconds={str(s): list(t) for s, t in zip(steps, secs)})))
    rows = {r["name"]: r for r in report(SimpleNamespace(save_dir=str(tmp_path), arm=base, at_step=None, seeds=None),
                                         ["full", "dsv"])}
    assert rows["full"]["logged_alone_seeds"] == [0, 1] and rows["dsv"]["logged_alone_seeds"] == [0]
    assert rows["full"]["time_to_full_loss_logged_s"] == 30.0
    assert rows["dsv"]["time_to_full_loss_logged_s"] == 8.0  # 0.6 reached at step 2
    assert rows["dsv"]["time_to_full_loss_ratio_logged"] == pytest.approx(8.0 / 30.0)
    assert rows["dsv"]["ms_step_logged"] == [(1, 4000.0), (2, 4000.0), (3, 4000.0)]
    assert rows["dsv"]["time_to_full_loss_ratio"] is None  # no timing phase ran
    from benchmarks.quality_report import plot

    pytest.importorskip("matplotlib")
    written = plot(list(rows.values()), str(tmp_path / "q"), "logged")
    assert all(os.path.getsize(p) > 0 for p in written)
