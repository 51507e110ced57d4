"""The recall benchmark runs end to end on the CPU (--quick) and its JSON files plot.

It is the tool that produces the issue's recall and overhead figures on the GPU; here it is run
in a subprocess (its own process group) on the tiny DiT, and the columns the README and the
notes quote are checked for presence and range, not for GPU-sized values.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

# starts, counts (frontier_launch.running_workers) or stops processes by name: in tests/conftest.py's PROCESS_FILES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_bench_recall_quick_writes_rows_and_trajectory(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_recall.py"), "--quick", "--predictor-input", "qk",
           "--background", "texture", "--log-every", "10", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " [qk] iteration     30 |" in proc.stdout  # progress lines
    files = sorted(p.name for p in tmp_path.iterdir())
    assert [f.split("-")[0] for f in files] == ["recall", "recall_trajectory"], files
    rows = json.loads((tmp_path / files[0]).read_text())["rows"]
    assert [r["layer"] for r in rows] == [1, 2, 3, 4] and all(r["stage"] == 2 for r in rows)
    for r in rows:
        assert 0.0 <= r["recall"] <= 1.0 and 0.0 <= r["sparsity_measured"] <= 1.0
        assert r["ms_step"] > 0 and r["ms_step_dense"] > 0 and r["background"] == "texture"
    trajectory = json.loads((tmp_path / files[1]).read_text())["rows"]
    assert {r["stage"] for r in trajectory} == {1, 2} and {r["layer"] for r in trajectory} == {1, 2, 3, 4}

    sys.path.insert(0, ROOT)
    from benchmarks.plot_results import main as plot

    written = plot(["--results", str(tmp_path)])
    assert sorted(os.path.basename(p) for p in written) == [f[:-5] + ".png" for f in files]


def _run_bench(script, tmp_path, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick", "--out-dir", str(tmp_path), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(600)
def test_bench_sparsity_emergence_quick_rows_per_arm(tmp_path):
    arm = "data=synthetic,frames=4,res=64,steps=9,stage1=4"
    proc = _run_bench("bench_sparsity_emergence.py", tmp_path, "--arm", arm, "--arm", arm + ",qk_norm=0,lr=1e-3")
    assert " [synthetic-dsv-S256] iteration      6/9 |" in proc.stdout and "sparsity" in proc.stdout
    (path,) = tmp_path.glob("sparsity_emergence-*.json")
    assert path.with_suffix(".png").stat().st_size > 0
    rows = json.loads(path.read_text())["rows"]
    assert {r["arm"] for r in rows} == {"synthetic-dsv-S256", "synthetic-dsv-lr0.001-qknorm0-S256"}
    profiles = [r for r in rows if r["kind"] == "profile" and r["arm"] == "synthetic-dsv-S256"]
    assert [r["step"] for r in profiles] == [1, 4, 7] and {r["stage"] for r in profiles} == {1, 2}
    for r in profiles:
        assert len(r["sparsity"]) == r["layers"] == 2 and 0.0 < r["sparsity_mean"] < 1.0 and r["S"] == 256
        # the budgets rise at once and fall with the momentum: never below the last profile's own measurement
        assert all(b >= m - 1e-6 for b, m in zip(r["budget_density_layers"], r["budget_density_measured_layers"]))
    final = [r for r in rows if r["kind"] == "final"]
    assert [r["steps"] for r in final] == [9, 9] and all(r["val_loss"] > 0 for r in final)
    sweeps = [r for r in rows if r["kind"] == "sweep" and r["arm"] == "synthetic-dsv-S256"]
    lists = [r["list_density"] for r in sweeps if "list_density" in r]
    assert sweeps and len(lists) == len({r["step"] for r in sweeps})  # one t per sweep carries the lists
    for dens in lists:  # per layer: sharing a list and keeping blocks whole never cost fewer keys
        names = list(dens)
        assert names[0] == "query" and len(names) >= 2
        for a, b in zip(names, names[1:]):
            assert all(x <= y + 1e-12 for x, y in zip(dens[a], dens[b]))
    for r in sweeps:  # the predictor's lists on the oracle's queries: the oracle is the best list of every length
        if "list_density" not in r:
            assert "predictor_list_density" not in r
            continue
        pred = r["predictor_list_density"]
        # the arms' DSVConfig: 4x4x8 cubes, 128-key blocks; ranked by the predictor, then by the exact logits
        assert list(pred) == ["g128_tokens", "g128_blocks128", "exact_g128_tokens", "exact_g128_blocks128"]
        for name, vals in pred.items():
            assert len(vals) == len(r["sparsity"]) == 2 and all(0.0 <= v <= 1.0 for v in vals), name
            assert all(p >= o - 1e-9 for p, o in zip(vals, r["list_density"][name.removeprefix("exact_")])), name


def test_bench_sparsity_emergence_merge_parts_and_lost_logs(tmp_path):
    """Calls' JSONs merge by (arm, step, kind) and a lost JSON's log adds kind=log rows, plotted."""
    sys.path.insert(0, ROOT)
    from benchmarks.bench_sparsity_emergence import main, rows_from_log

    def part(name, date, arm, steps):
        rows = [dict(kind="profile", arm=arm, step=s, sparsity_mean=0.5, sparsity_max=0.6) for s in steps]
        (tmp_path / name).write_text(json.dumps(dict(meta=dict(date=date, gpu="G"), rows=rows)))
        return str(tmp_path / name)

    a = part("a.json", "2026-12-01T01", "x", [1, 26])
    b = part("b.json", "2026-12-01T02", "x", [26, 51])  # step 26 in both: kept once
    log = tmp_path / "lost.log"
    log.write_text("warning\n [y-S8K] iteration     50/900 | ms/step    150.0 | tokens/s      54000 | loss 1.9000 | "
                   "stage 1 | sparsity 0.881 (smoothed 0.825) | density 0.792 | recall 0.980 | sparse layers 0/4\n")
    out = tmp_path / "m.json"
    main(["--merge", a, b, "--log", str(log), "--out", str(out), "--note", "two calls"])
    merged = json.loads(out.read_text())
    assert [(r["arm"], r["step"], r["kind"]) for r in merged["rows"]] == [
        ("x", 1, "profile"), ("x", 26, "profile"), ("x", 51, "profile"), ("y-S8K", 50, "log")]
    assert merged["meta"]["date"] == "2026-12-01T02" and merged["meta"]["note"] == "two calls"
    assert [p["file"] for p in merged["meta"]["parts"]] == ["a.json", "b.json", "lost.log"]
    log_row = merged["rows"][-1]
    assert log_row["sparsity_mean"] == 0.881 and log_row["layers"] == 4 and log_row["loss"] == 1.9
    assert out.with_suffix(".png").stat().st_size > 0
    (tmp_path / "empty.log").write_text("no iteration lines\n")
    with pytest.raises(ValueError, match="empty.log"):
        rows_from_log(str(tmp_path / "empty.log"))


@pytest.mark.timeout(600)
def test_bench_quality_quick_frontier_every_phase(tmp_path):
    """--quick trains every frontier arm at two seeds on the same clips, times each arm alone from its run,
    and writes the frontier JSON (one row per arm, paired deltas) and both plots."""
    proc = _run_bench("bench_quality.py", tmp_path, "--arms", "full,control,local,window")
    assert "== local seed 1:" in proc.stdout and "[time] window S=256" in proc.stdout
    (path,) = tmp_path.glob("quality-frontier-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["name"] for r in rows] == ["full", "control", "local", "window"]
    for r in rows:
        assert r["seeds"] == [0, 1] and r["steps"] == 8 and r["S"] == 256
        assert r["val_loss"] > 0 and r["ms_step_alone"] > 0 and len(r["curve"]) == 2
        assert r["delta_vs_full_se_pct"] == r["delta_vs_full_se_pct"]  # two seeds: a standard error
        # each seed's own curve, whose mean is the row's curve (what a later study joins)
        assert sorted(r["curve_per_seed"]) == ["0", "1"]
        assert [v for _, v in r["curve"]] == pytest.approx(
            [sum(dict(c)[s] for c in r["curve_per_seed"].values()) / 2 for s, _ in r["curve"]])
    full = rows[0]
    assert full["delta_vs_full_pct"] == 0.0 and full["kept_fraction"] == 1.0 and full["time_to_full_loss_ratio"] == 1.0
    assert rows[2]["local_radius"] == "0.1.1" and 0 < rows[3]["kept_fraction"] < 1
    # stage-2 steps charged by the share of layers that ran sparse between validations (counts in the curves)
    assert rows[2]["stage2_charging"] == "per_interval" and rows[0]["stage2_charging"] is None
    # DSV arms: plain and profile steps clocked apart, the step charged plain + (profile - plain) / period
    t = rows[2]["ms_step_alone_by_S"]["256"]
    assert t["stage2"] == pytest.approx(t["stage2_plain"] + (t["stage2_profile_step"] - t["stage2_plain"]) / 2)
    assert 0.0 <= t["stage2_sparse_share"] <= 1.0  # the share of layers the clocked stage-2 step ran sparse
    assert "[profile] local S=256 stage2 (plain steps)" in proc.stdout
    for suffix in ("_curves.png", "_frontier.png"):
        assert (tmp_path / (path.stem + suffix)).stat().st_size > 0
    # each curve file keeps the loss per class and per timestep at every validation step
    curve = json.loads((tmp_path / "frontier-quick" / "curves" / "window-s1.json").read_text())
    assert sorted(curve["val_breakdown"]) == sorted(str(step) for step, _ in curve["curve"])
    assert all(len(b["by_t"]) == 5 and b["by_class"] for b in curve["val_breakdown"].values())


def _run_args(tmp_path, *extra):
    import argparse

    sys.path.insert(0, ROOT)
    from benchmarks.video_runs import add_run_args

    ap = argparse.ArgumentParser()
    add_run_args(ap, preset="tiny", layers=2, samples=3)
    return ap.parse_args(["--val-samples", "1", "--profile-every", "2", "--log-every", "4", "--val-every", "4",
                          "--warmup", "2", "--workers", "1", *extra])


@pytest.mark.timeout(300)
def test_video_run_resumes_exactly(megatron_cpu, tmp_path):
    """A run saved at step 5 and resumed to step 10 ends where a 10-step run does (weights, DSV state,
    counters); a checkpoint of another arm or a damaged file is refused with a clear error."""
    from benchmarks.video_runs import parse_arm, train_arm

    arm = "data=synthetic,frames=4,res=64,stage1=3,steps="
    straight = train_arm(parse_arm(arm + "10"), _run_args(tmp_path))
    args = _run_args(tmp_path, "--save-dir", str(tmp_path / "runs"))
    train_arm(parse_arm(arm + "5"), args)
    assert (tmp_path / "runs" / "synthetic-dsv-S256.pt").exists()
    resumed = train_arm(parse_arm(arm + "10"), args)
    assert resumed[2]["steps"] == 10 and resumed[2]["val_loss"] == straight[2]["val_loss"]
    a, b = straight[0].state_dict(), resumed[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))
    assert resumed[2]["sparsity_mean"] == straight[2]["sparsity_mean"]
    with pytest.raises(ValueError, match="another arm"):
        train_arm(parse_arm(arm + "12,lr=1e-3,label=synthetic-dsv-S256"), args)
    (tmp_path / "runs" / "synthetic-dsv-S256.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read run checkpoint"):
        train_arm(parse_arm(arm + "12"), args)


@pytest.mark.timeout(300)
def test_bench_cp_quick_two_ranks(tmp_path):
    """bench_cp.py under torchrun on 2 gloo ranks: four methods, bytes counted, the DSV plan recorded."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "benchmarks", "bench_cp.py"), "--quick", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("cp-quick-*.json")
    data = json.loads(path.read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert sorted(rows) == sorted(["dsv_hybrid", "naive_hcp", "naive_scp", "dense_ulysses"])
    assert data["meta"]["gpu_count"] == 2 and rows["dsv_hybrid"]["plan"]["layout"]["hcp"] in (1, 2)
    assert rows["naive_scp"]["bytes_vs_full_kv_gather"] == 1.0
    # naive SCP receives all of the other rank's K and V (4 heads x 256 rows x 64, fp32) and returns their grads
    assert rows["naive_scp"]["bytes_recv_per_rank"] == 2 * 2 * 4 * 256 * 64 * 4
    for r in rows.values():
        assert r["ms_fwd_bwd"] > 0 and r["speedup_vs_dense_ulysses"] > 0


@pytest.mark.timeout(600)
def test_bench_e2e_quick_four_arms(tmp_path):
    """bench_e2e.py --quick: every arm timed on the tiny model, the step split into parts, a plot written."""
    _run_bench("bench_e2e.py", tmp_path)
    (path,) = tmp_path.glob("e2e-*.json")
    assert path.with_suffix(".png").stat().st_size > 0
    rows = {r["arm"]: r for r in json.loads(path.read_text())["rows"]}
    assert sorted(rows) == sorted(["full", "dsv_stage2", "dsv_stage1", "window"])
    for r in rows.values():
        assert r["S"] == 256 and r["ms_step"] > 0 and r["ms_dense_step"] == rows["full"]["ms_step"]
        parts = sum(r[f"ms_{p}"] for p in ("attention", "selection", "predictor", "profiler", "linear_rest"))
        assert parts == pytest.approx(r["ms_step"]) or r["ms_linear_rest"] == 0.0
    assert rows["dsv_stage2"]["budget_source"].startswith("spread 0.80..0.98")
    assert rows["dsv_stage1"]["ms_profile_step"] > 0 and rows["dsv_stage1"]["profile_every"] == 25


@pytest.mark.timeout(600)
def test_bench_e2e_quick_token_lists(tmp_path):
    """--granularity token reaches the DSV arms' config and their rows; the dense arms carry none."""
    _run_bench("bench_e2e.py", tmp_path, "--granularity", "token", "--arms", "full", "dsv_stage2", "dsv_stage1",
               "--tag=-token")
    (path,) = tmp_path.glob("e2e-token-*.json")
    rows = {r["arm"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["full"]["granularity"] is None
    for arm in ("dsv_stage2", "dsv_stage1"):
        assert rows[arm]["granularity"] == "token" and rows[arm]["ms_step"] > 0


def _bench_sparse_attention():
    """The kernel benchmark's module, imported here without side effects (its env defaults are set in main)."""
    sys.path.insert(0, ROOT)
    before = {k: os.environ.get(k) for k in ("DSV_SKIP_CHECKS", "DSV_SPARSE_ATTN_BACKEND")}
    import benchmarks.bench_sparse_attention as bench

    assert {k: os.environ.get(k) for k in before} == before
    return bench


def _sparse_attention_sweep():
    """The sweep's planning and plotting module (imports without side effects too)."""
    _bench_sparse_attention()
    import benchmarks.sparse_attention_sweep as sweep

    return sweep


def test_sparse_attention_sweep_default_grid_and_estimate():
    """Issue #15's default grid: every (D, G, granularity) cell at 16K and 64K, 90%, the heatmap's
    points first; the extra S and sparsities only at D=128 and 256 with G=128 blocks; under 6 min
    on the time model with 8 warm shards, each point warmed by exactly one shard."""
    sweep = _sparse_attention_sweep()
    pts = sweep.sweep_grid()
    cells = {(d, g, bs) for d in (64, 96, 128, 256) for g in (32, 64, 128) for bs in (0, 128)}
    assert len(pts) == 68 and not any(p.get("skipped") for p in pts)
    assert [p["phase"] for p in pts] == ["heatmap"] * 24 + ["base"] * 24 + ["extra"] * 20
    assert {(p["D"], p["G"], p["block_size"]) for p in pts[:24]} == cells
    assert all((p["S"], p["sparsity"]) == (65536, 0.9) for p in pts[:24])
    combos = {}
    for p in pts:
        combos.setdefault((p["D"], p["G"], p["block_size"]), set()).add((p["S"], p["sparsity"]))
    extra = {(128, 128, 128), (256, 128, 128)}
    for cell in cells - extra:
        assert combos[cell] == {(16384, 0.9), (65536, 0.9)}, cell
    for cell in extra:
        assert combos[cell] == {(S, sp) for S in (16384, 32768, 65536, 131072) for sp in (0.8, 0.9, 0.95)}
    assert [p["S"] for p in pts[48:]] == sorted(p["S"] for p in pts[48:])  # the 128K extras last
    for p in pts:
        assert p["granularity"] == ("token" if p["block_size"] == 0 else "block") and p["H"] == 16

    est = sweep.estimate_s(pts, warm_shards=8)
    assert est["points"] == 68 and 0 < est["warm_s"] and est["total_s"] < 360
    assert sweep.estimate_s(pts)["total_s"] > est["total_s"]  # cold compiles in the timed run
    shards = sweep.warm_shards_of(pts, 8)
    warmed = sorted((p["S"], p["D"], p["G"], p["block_size"], p["sparsity"])
                    for shard in shards for u in shard for p in u["points"])
    assert warmed == sorted((p["S"], p["D"], p["G"], p["block_size"], p["sparsity"]) for p in pts)
    assert all(shards)
    flex_units = [u for shard in shards for u in shard if u["flex"]]
    assert {u["key"][:3] for u in flex_units} == {(d, 128, 128) for d in (64, 96, 128, 256)}
    assert len(flex_units) == 12  # one compile per (S, D): 4 D at 16K and 64K, 2 D at 32K and 128K


def test_sparse_attention_sweep_overrides_and_skipped_reasons():
    """--seq-lens / --sparsities replace the grid by their product (no extras); combinations the
    library rejects are kept as points with the library's own message."""
    sweep = _sparse_attention_sweep()
    pts = sweep.sweep_grid(dims=(80, 128), groups=(128, 256), granularity="block", block_sizes=(128, 32),
                           seq_lens=[32768], sparsities=[0.8, 0.95])
    assert len(pts) == 2 * 2 * 2 * 2 and {p["S"] for p in pts} == {32768}
    run = [p for p in pts if not p.get("skipped")]
    assert {(p["D"], p["G"], p["block_size"], p["sparsity"]) for p in run} == {(128, 128, 128, 0.8),
                                                                             (128, 128, 128, 0.95)}
    why = {(p["D"], p["G"], p["block_size"]): p["skipped"] for p in pts if p.get("skipped")}
    assert "head dim D=80" in why[(80, 128, 128)] and "head dim D=80" in why[(80, 256, 32)]
    assert "group_size" in why[(128, 256, 128)] and "block_size" in why[(128, 128, 32)]
    assert all(w.startswith("unsupported by the library") for w in why.values())
    assert sweep.estimate_s(pts)["points"] == 2
    token = sweep.sweep_grid(dims=(64,), groups=(32,), granularity="token", seq_lens=[16384])
    assert [(p["block_size"], p["granularity"], p["sparsity"]) for p in token] == [(0, "token", 0.9)]
    assert sweep.flex_skip_reason(128, 128) is None and sweep.flex_skip_reason(128, 0)
    assert sweep.flex_skip_reason(64, 128) and sweep.flex_skip_reason(128, 64)


def test_tune_space_adds_the_artifact_shape_for_small_token_groups():
    """--tune times the DSV artifact's token-forward shape (4 warps, 128- or 256-key steps) only where its
    forward was the faster one (G = 32, D <= 128); other passes, groups and head dims keep their spaces."""
    from benchmarks import sparse_attention_tune as sweep

    small = sweep.tune_space("fwd_tok", 128, 32)
    assert small[:len(sweep.TUNE_SPACE["fwd_tok"])] == sweep.TUNE_SPACE["fwd_tok"]
    assert (32, 128, 4, 3) in small and (32, 256, 4, 2) in small and len(set(small)) == len(small)
    assert sweep.tune_space("fwd_tok", 128, 128) == sweep.TUNE_SPACE["fwd_tok"]
    assert sweep.tune_space("fwd_tok", 256, 32) == sweep.TUNE_SPACE_BIG["fwd_tok"]
    assert sweep.tune_space("bwd_q_tok", 128, 32) == sweep.TUNE_SPACE["bwd_q_tok"]


def test_sparse_attention_sweep_heatmap(tmp_path):
    """The heatmap from rows written here (no committed numbers): D down, (G, granularity) across,
    blank cells for a skipped point and where flex did not run; the PNG is written."""
    sweep = _sparse_attention_sweep()
    rows = []
    for i, (d, g, bs) in enumerate([(64, 128, 128), (64, 128, 0), (256, 128, 128), (256, 32, 0)]):
        rows.append(dict(S=65536, H=16, D=d, B=1, G=g, group_size=g, block_size=bs, sparsity=0.9,
                         speedup_fwd_bwd=2.0 + i, speedup_vs_flex_fwd_bwd=1.0 + i / 10 if bs else None))
    rows.append(dict(S=65536, H=16, D=96, B=1, G=32, group_size=32, block_size=0, sparsity=0.9, skipped="why"))
    rows.append(dict(S=16384, H=16, D=64, B=1, G=128, group_size=128, block_size=128, sparsity=0.9,
                     speedup_fwd_bwd=99.0, speedup_vs_flex_fwd_bwd=9.0))  # another S: not in the map
    dims, cols, cudnn, flex = sweep.heatmap_grid(rows)
    assert dims == [64, 96, 256] and cols == ["G32\ntoken", "G128\ntoken", "G128\nblock128"]
    nan = float("nan")
    assert cudnn.ravel().tolist() == pytest.approx([nan, 3.0, 2.0, nan, nan, nan, 5.0, nan, 4.0], nan_ok=True)
    assert flex.ravel().tolist() == pytest.approx([nan, nan, 1.0, nan, nan, nan, nan, nan, 1.2], nan_ok=True)
    png = sweep.plot_sweep(rows, tmp_path / "sweep.png", dict(gpu="test", torch="t", commit="c"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000
    sweep.plot_sweep([], tmp_path / "empty.png")  # nothing measured yet: still a figure
    assert (tmp_path / "empty.png").stat().st_size > 0


@pytest.mark.timeout(300)
def test_bench_sparse_attention_cli_help_and_budget(tmp_path):
    """--help; a sweep whose time budget is spent before the first point touches no GPU: every row is
    written with its reason, with the heatmap beside the JSON; --plot-only redraws it."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = os.path.join(ROOT, "benchmarks", "bench_sparse_attention.py")

    def run(*args):
        proc = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=280)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    out = run("--help")
    for flag in ("--sweep", "--head-dim", "--heads", "--group-size", "--granularity", "--seq-lens", "--sparsities",
                 "--time-budget-s", "--warm-shards", "--lists", "Estimated H200 time"):
        assert flag in out, flag
    out = run("--sweep", "--head-dim", "80,128", "--group-size", "128", "--seq-lens", "16K,64K",
              "--time-budget-s", "0", "--out", str(tmp_path))
    assert "estimated H200 time" in out
    (path,) = tmp_path.glob("sparse_attention-sweep-*.json")
    data = json.loads(path.read_text())
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 2 and all(r["skipped"] for r in rows)
    assert sum(r["skipped"].startswith("time budget") for r in rows) == 4
    assert sum("head dim D=80" in r["skipped"] for r in rows) == 4
    assert data["meta"]["sweep"]["estimate"]["points"] == 4 and data["meta"]["sweep"]["heatmap_at"] == [65536, 0.9]
    png = path.with_suffix(".png")
    assert png.stat().st_size > 0
    png.unlink()
    run("--plot-only", str(path))
    assert png.stat().st_size > 0
    # video-shaped lists go to their own file: the random sweep of the same day stays
    run("--sweep", "--head-dim", "128", "--group-size", "128", "--seq-lens", "16K", "--time-budget-s", "0",
        "--lists", "video", "--out", str(tmp_path))
    assert path.exists() and len(list(tmp_path.glob("sparse_attention-sweep-video-*.json"))) == 1


@pytest.mark.parametrize("S,G,BS", [(4096, 32, 0), (5000, 64, 0), (8192, 128, 128), (3000, 32, 64)])
def test_video_lists_are_valid_and_local(S, G, BS):
    """``--lists video``: every group keeps K = round(0.1 * items) distinct sorted item ids in range (odd S: a partial
    last group and block); the same seed gives the same lists; neighbouring groups share several times more of their
    lists than uniform random lists do (their expected Jaccard d / (2 - d)), and a group's own cube is in its list."""
    _bench_sparse_attention()
    from benchmarks.list_shapes import neighbour_overlap, video_lists

    idx, cnt, kept = video_lists(S, G, BS, 0.9, heads=3, batch=2, seed=4)
    n_items = S if BS == 0 else -(-S // BS)
    K = max(1, round(0.1 * n_items))
    assert idx.shape == (2, 3, -(-S // G), K) and idx.dtype == torch.int32 and cnt.tolist() == [[K] * 3] * 2
    assert kept == K * (BS or 1)
    assert (idx >= 0).all() and (idx < n_items).all() and (idx[..., 1:] > idx[..., :-1]).all()
    assert torch.equal(idx, video_lists(S, G, BS, 0.9, heads=3, batch=2, seed=4)[0])
    assert not torch.equal(idx, video_lists(S, G, BS, 0.9, heads=3, batch=2, seed=5)[0])
    d = K / n_items
    assert neighbour_overlap(idx, cnt, n_items) > 3 * d / (2 - d)
    gen = torch.Generator().manual_seed(0)
    rand = torch.rand(2, 3, idx.shape[2], n_items, generator=gen).argsort(-1)[..., :K].sort(-1).values
    assert neighbour_overlap(rand.int(), cnt, n_items) < 1.5 * d / (2 - d)
    own = torch.arange(idx.shape[2]) * G // (BS or 1)  # each group's first token (or its block)
    assert (idx == own.view(1, 1, -1, 1)).any(-1).float().mean() > 0.9
    with pytest.raises(ValueError, match="sparsity"):
        video_lists(S, G, BS, 1.0, heads=1)


def test_meta_tree_names_the_working_tree(tmp_path):
    """``meta.tree`` is the tree a commit of exactly the working tree would have (ignored files left out),
    whatever HEAD says: how a result from a copied checkout with a stale HEAD finds its commit."""
    import subprocess

    from benchmarks.common import _git_tree

    def git(*a):
        return subprocess.check_output(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=tmp_path,
                                       text=True).strip()

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    assert _git_tree(str(tmp_path)) == git("rev-parse", "HEAD^{tree}")
    (tmp_path / "a.py").write_text("x = 2\n")  # a dirty copy of a newer commit
    (tmp_path / "b.py").write_text("y = 1\n")
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big.bin").write_text("not code\n")
    dirty = _git_tree(str(tmp_path))
    assert dirty != git("rev-parse", "HEAD^{tree}")
    git("add", "a.py", "b.py")
    git("commit", "-qm", "two")
    assert dirty == git("rev-parse", "HEAD^{tree}")
    assert git("status", "--porcelain") == ""  # the throw-away index left the real one alone


@pytest.mark.timeout(600)
def test_bench_wan_quick_two_arms(tmp_path):
    """bench_wan.py --quick: the tiny Wan's full and DSV stage-2 steps on a grid no multiple of the cube."""
    proc = _run_bench("bench_wan.py", tmp_path)
    assert "x" in proc.stdout.split("dsv_stage2:")[-1]  # the speedup line
    (path,) = tmp_path.glob("wan-*.json")
    data = json.loads(path.read_text())
    assert {"gpu", "torch", "date", "commit"} <= set(data["meta"])
    rows = {r["arm"]: r for r in data["rows"]}
    assert sorted(rows) == ["dsv_stage2", "full"]
    for r in rows.values():
        assert r["S"] == 300 and r["token_grid"] == [5, 6, 10] and r["ms_step"] > 0 and r["recompute"] == "none"
        assert r["ms_dense_step"] == rows["full"]["ms_step"] and r["grid_fit"]["mode"] == "none"
        assert "partial" in r["grid_fit"]["note"] and r["grid_fit"]["native_S"] == 300
    dsv = rows["dsv_stage2"]
    assert dsv["budget_source"].startswith("synthetic") and dsv["sparse_layers"] == 2 and 0.8 < dsv["sparsity"] < 0.95
    assert dsv["ms_step_amortised"] > 0
    assert dsv["speedup_step"] == pytest.approx(rows["full"]["ms_step"] / dsv["ms_step"])


def test_bench_wan_native_grid_and_fits():
    """Wan's 81 x 480 x 832 video: 21 x 60 x 104 latents, 32760 tokens as is, 26880 cropped, 43008 padded."""
    sys.path.insert(0, ROOT)
    from benchmarks.bench_wan import fit_grid, latent_grid

    native = latent_grid(81, 480, 832)
    assert native == (21, 60, 104)
    sizes = {}
    for mode in ("none", "crop", "pad"):
        grid, note = fit_grid(native, (1, 2, 2), (4, 4, 8), mode)
        sizes[mode] = grid[0] * (grid[1] // 2) * (grid[2] // 2)
        assert note
    assert sizes == {"none": 32760, "crop": 26880, "pad": 43008}
    assert fit_grid((4, 16, 32), (1, 2, 2), (4, 4, 8), "none")[1] == "native grid"  # whole cubes: nothing partial
    for bad in ((80, 480, 832), (81, 484, 832)):
        with pytest.raises(ValueError, match="--frames|--height"):
            latent_grid(*bad)


@pytest.mark.timeout(400)
def test_host_ops_counts_every_step_kind(tmp_path):
    """benchmarks/host_ops.py counts a step's torch ops and syncs per kind and by caller (naive kernels, 512
    tokens): both DSV layers sparse in stage 2; a plain step leaves the dispatcher alone (its decision is kept
    over steps that bring no profile), a profile step renews it."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               DSV_SPARSE_ATTN_BACKEND="naive", DSV_TOPK_BACKEND="naive")
    out = tmp_path / "ops.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "host_ops.py"), "--layers", "2", "--frames", "2",
           "--res", "128", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stage2_plain" in proc.stdout and "callers by ops" in proc.stdout
    steps = json.loads(out.read_text())["steps"]["512"]  # per length: 2 frames x (128 / 8)^2 tokens
    assert set(steps) == {"full", "stage2_plain", "stage2_predictor", "stage2_profile", "stage1"}
    assert steps["stage2_plain"]["sparse_layers"] == 2 and steps["stage1"]["sparse_layers"] == 0
    assert steps["full"]["ops"] < steps["stage2_plain"]["ops"] < steps["stage2_profile"]["ops"]
    dispatcher = lambda kind: sum(n for w, n in steps[kind]["ops_by_caller"].items()  # noqa: E731
                                  if w.startswith("megatron_dsv.attention.dispatcher"))
    assert dispatcher("stage2_plain") == 0 and dispatcher("stage2_profile") > 0
    if not torch.cuda.is_available():  # --time clocks kernels and syncs: a CPU is refused, naming the flag
        proc = subprocess.run(cmd + ["--time"], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "--time needs a GPU" in proc.stderr
