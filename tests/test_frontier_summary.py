"""benchmarks/frontier_summary.py: one frontier over every study's results (most seeds wins, joined seeds placed by
their sources, the default's verdict against issue 24's targets)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import frontier_summary as fs  # noqa: E402


def _row(name, seeds, delta, se, steps=3000, data="vizdoom", S=16384, kept=0.23):
    return dict(bench="quality_frontier", kind="arm", name=name, data=data, S=S, steps=steps, seeds=seeds,
                delta_vs_full_pct=delta, delta_vs_full_se_pct=se, kept_fraction=kept, sparse_layer_fraction=1.0,
                recall=0.5, time_to_full_loss_ratio=None, schedule="constant", batch=1,
                init_seed=None, order_seed=None)  # schedule, batch, init_seed, order_seed: as collect() sets them


def _study(path, date, rows, gpu="NVIDIA H200"):
    with open(path, "w") as f:
        json.dump(dict(meta=dict(gpu=gpu, date=date, note=os.path.basename(path)),
                       rows=[_row("full", r["seeds"], 0.0, 0.0) for r in rows[:1]] + rows), f)
    return str(path)


def test_most_seeds_win_and_joined_seeds_take_their_sources_place(tmp_path):
    a = _study(tmp_path / "quality-frontier-runA.json", "2026-12-01", [
        _row(fs.DEFAULT_ARM, [0, 1], -1.0, 0.9), _row("window", [0, 1], -2.0, 0.5, kept=0.29),
        _row("paper", [0, 1], float("nan"), None)])  # a row without a delta: left out
    b = _study(tmp_path / "quality-frontier-runB.json", "2026-12-05", [
        _row(fs.DEFAULT_ARM, [2, 3, 4], -3.0, 0.6), _row("window", [2, 3], -1.0, 0.4, kept=0.29),
        _row(fs.DEFAULT_ARM, [5, 6, 7], +2.5, 0.3, data="footage")], gpu="NVIDIA H100 80GB HBM3")
    joined = tmp_path / "quality-joined-x.json"
    per_seed = [dict(seed=s, file=os.path.basename(f), gpu=g) for s, f, g in
                [(0, a, "NVIDIA H200"), (1, a, "NVIDIA H200"), (2, b, "NVIDIA H100 80GB HBM3")]]
    with open(joined, "w") as f:
        json.dump(dict(meta=dict(date="2026-12-06"), result=dict(
            arm=fs.DEFAULT_ARM, step=3000, seeds=[0, 1, 2], per_seed=per_seed, delta_vs_full_pct=-2.0,
            delta_vs_full_se_pct=0.45)), f)
    rows = fs.collect([a, b, str(joined)])
    by = {(r["data"], r["name"]): r for r in rows}
    assert len(rows) == 3 and ("vizdoom", "paper") not in by
    # three seeds in each of B's row and the joined one: the newer (the joined result) wins the tie
    assert by[("vizdoom", fs.DEFAULT_ARM)]["source"] == "quality-joined-x.json"
    assert by[("vizdoom", fs.DEFAULT_ARM)]["gpu"] == "NVIDIA H100 80GB HBM3 + NVIDIA H200"
    assert by[("vizdoom", "window")]["delta_vs_full_pct"] == -1.0  # two seeds each: the newer file's row
    verdict = {v["data"]: v for v in fs.default_verdict(rows)}
    assert verdict["vizdoom"]["se_target_met"] and verdict["vizdoom"]["at_most_1pct_above_full"]
    assert not verdict["footage"]["at_most_1pct_above_full"] and verdict["footage"]["se_target_met"]


def test_main_writes_json_and_png_from_the_committed_results(tmp_path, capsys):
    out = tmp_path / "summary"
    assert fs.main(["--out", str(out)]) == 0
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert os.path.getsize(tmp_path / "summary.png") > 10_000
    names = {(r["data"], r["name"]) for r in doc["rows"]}
    assert ("vizdoom", "window") in names and ("vizdoom", "paper") in names and ("footage", fs.DEFAULT_ARM) in names
    assert all(r["seeds"] and r["steps"] for r in doc["rows"])
    assert {p["S"] for p in doc["default"]["points"] if p["data"] == "vizdoom"} >= {16384, 32768, 65536}
    assert "wrote" in capsys.readouterr().out


def test_default_rows_are_todays_design_and_settings_are_the_studys_own():
    """A row named "default" is the library default only where its study marked it so at today's stage switch
    (run 4's "default" was another design); each row's settings are those its study recorded."""
    old = dict(_row("default", [0, 1], 0.0, 0.2), library_default=True, stage1=700, budget_rule="recall")
    new = dict(_row("default", [0, 1], -1.0, 0.2), library_default=True, stage1=400, budget_rule="sparsity")
    assert not fs.is_default(old) and fs.is_default(new) and fs.is_default(_row(fs.DEFAULT_ARM, [0], 0.0, None))
    assert fs.settings_of(old) == "budget_rule=recall,stage1=700"


def test_why_is_built_from_the_rows():
    """The default's justification names its own points and every arm at the same steps that came out below it."""
    rows = [dict(_row(fs.DEFAULT_ARM, [0, 1, 2], -1.0, 0.3), library_default=True, source="a"),
            dict(_row("window", [0, 1], -1.8, 0.5, kept=0.29), library_default=False),
            dict(_row("paper", [0, 1], +0.6, 0.2), library_default=False),
            dict(_row("tok", [0, 1], -3.0, 0.2), steps=1500, library_default=False)]  # other steps: not a peer
    why = fs.why_default(rows)
    assert f"vizdoom 16K @3000: {fs.DEFAULT_ARM} -1.00 +- 0.30% (3 seeds, kept 0.23)" in why
    assert "of 2 other arms at these steps, below it: window -1.80 +- 0.50% (2 seeds, kept 0.29)" in why
    assert "paper" not in why and "tok" not in why


def test_a_cooldown_study_is_its_own_row_and_the_verdict_keeps_the_constant_rate(tmp_path):
    """Run 30 repeated run 29 with a learning-rate cooldown: the same data, length, arm, steps and seeds, another
    schedule. Both rows stay (the newer does not replace the older), each labelled; the default's verdict takes the
    constant rate's row, as every other study ran."""
    cooldown = dict(decay_end=3000, decay_start=2100, min_frac=0.0, warmup=100)
    a = _study(tmp_path / "quality-frontier-r29.json", "2026-12-07T15", [_row(fs.DEFAULT_ARM, [0, 1, 2], -3.7, 4.4)])
    b = _study(tmp_path / "quality-frontier-r30.json", "2026-12-07T19",
               [dict(_row(fs.DEFAULT_ARM, [0, 1, 2], -3.2, 4.1), lr_schedule=cooldown)])
    rows = fs.collect([a, b])
    assert sorted(r["schedule"] for r in rows) == ["constant", "cooldown 0.3"]
    assert fs.default_verdict(rows)[0]["delta_vs_full_pct"] == -3.7
    assert fs.schedule_of(dict(lr_schedule={"constant": True})) == "constant"
    assert fs.schedule_of(dict(lr_schedule=dict(cooldown, decay_start=3000))) == "constant"  # no decay: constant


def test_a_study_of_another_batch_or_a_fixed_init_is_its_own_row(tmp_path):
    """Run 31 trains footage 8K at batch 4 (1,500 steps): a row apart from batch 1's, labelled, and the verdict takes
    the row with the most seeds, then the most clips trained on (steps x batch); a fixed-init study, and one that also
    fixes the clip order, are rows of their own too."""
    a = _study(tmp_path / "quality-frontier-r29.json", "2026-12-07T15", [_row(fs.DEFAULT_ARM, [0, 1, 2], -3.7, 4.4)])
    b = _study(tmp_path / "quality-frontier-r31.json", "2026-12-08T10",
               [dict(_row(fs.DEFAULT_ARM, [0, 1, 2], -2.0, 1.0, steps=1500), batch=4)])
    c = _study(tmp_path / "quality-frontier-r32.json", "2026-12-08T11",
               [dict(_row(fs.DEFAULT_ARM, [0, 1], -1.0, 0.5, steps=1500), batch=4, init_seed=0)])
    d = _study(tmp_path / "quality-frontier-r33.json", "2026-12-08T12",
               [dict(_row(fs.DEFAULT_ARM, [0, 1], -0.5, 0.4, steps=1500), batch=4, init_seed=0, order_seed=0)])
    rows = fs.collect([a, b, c, d])
    assert sorted((r["batch"], str(r["init_seed"]), str(r["order_seed"])) for r in rows) == \
        [(1, "None", "None"), (4, "0", "0"), (4, "0", "None"), (4, "None", "None")]
    assert any("init 0, order 0" in fs._harness_label(r) for r in rows)
    verdict = fs.default_verdict(rows)[0]
    assert verdict["delta_vs_full_pct"] == -2.0 and verdict["batch"] == 4  # 3 seeds each: 6,000 clips beat 3,000
    assert "@1500, batch 4:" in fs.why_default(rows)
    assert fs.main([a, b, c, "--out", str(tmp_path / "summary")]) == 0
    doc = json.load(open(tmp_path / "summary.json"))
    assert sorted(r["batch"] for r in doc["rows"]) == [1, 4, 4]
