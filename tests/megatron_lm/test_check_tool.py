"""tools/megatron_lm_check.py (the GPU check's log parser and comparison), the check script's dry run,
and examples/megatron_lm/fusion_flags.py. CPU only, no Megatron-LM needed."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(rel, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, rel))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _load("tools/megatron_lm_check.py", "megatron_lm_check_under_test")
fusion = _load("examples/megatron_lm/fusion_flags.py", "fusion_flags_under_test")


def _line(it, loss, n=20, key="lm loss"):
    """One iteration line as Megatron-LM core_v0.16.1 prints it (training_log)."""
    return (f" [2026-12-01 20:17:17.738704] iteration {it:8d}/{n:8d} | consumed samples: {it:12d} | "
            f"elapsed time per iteration (ms): 42.6 | learning rate: 9.939057E-05 | global batch size:     1 | "
            f"{key}: {loss:.6E} | loss scale: 1.0 | grad norm: 1.523 | number of skipped iterations:   0 | "
            f"number of nan iterations:   0 |")


def _log(true, its, key="lm loss", dsv=True):
    """The log of one process that trained ``its``: Megatron's first-iteration carry included (the second
    printed loss is the mean of the first two), plus [dsv] lines (stage 2 from iteration 4)."""
    its = list(its)
    lines = ["> building GPT model ...", " validation loss at iteration 10 | lm loss value: 7.5E+00 |"]
    for k, it in enumerate(its):
        printed = (true[its[0]] + true[it]) / 2 if k == 1 else true[it]
        lines.append(_line(it, printed, key=key))
        if dsv:
            stage, sparse = (2, 2) if it >= 5 else (1, 0)
            lines.append(f" [dsv] iteration {it:8d} | stage {stage} | sparse layers {sparse}/2 | sparsity 0.579 | "
                         f"predictor loss 6.0E-01")
    return "\n".join(lines)


TRUE = {i: 8.5 - 0.07 * i + 0.01 * (i % 3) for i in range(1, 21)}


def _logs(true_resumed=TRUE, dsv=True):
    return {"a": _log(TRUE, range(1, 21), dsv=dsv), "b": _log(TRUE, range(1, 21), dsv=dsv),
            "first": _log(TRUE, range(1, 11), dsv=dsv), "resumed": _log(true_resumed, range(11, 21), dsv=dsv)}


def test_parse_log_reads_iteration_and_dsv_lines():
    parsed = check.parse_log(_log(TRUE, range(1, 4)))
    assert parsed["loss_key"] == "lm loss" and parsed["train_iters"] == 20
    assert sorted(parsed["printed"]) == [1, 2, 3]  # the validation line is not an iteration line
    assert parsed["printed"][2] == pytest.approx((TRUE[1] + TRUE[2]) / 2, rel=1e-6)
    assert parsed["dsv"][3] == (1, 0, 2)
    assert check.parse_log(_log(TRUE, range(1, 3), key="flow loss"))["loss_key"] == "flow loss"


def test_run_losses_undoes_megatrons_first_iteration_carry():
    """The issue's numbers: resumed at 10, Megatron printed mean(L11, L12) = 7.1305 at 12, where the
    uninterrupted run printed L12 = 7.0397; undone, the two agree."""
    l11, l12 = 2 * 7.1305 - 7.0397, 7.0397
    resumed = check.run_losses({11: l11, 12: (l11 + l12) / 2, 13: 6.9})
    assert resumed[12] == pytest.approx(7.0397, rel=1e-12) and resumed[11] == l11 and resumed[13] == 6.9
    with pytest.raises(ValueError, match="consecutive"):
        check.run_losses({1: 1.0, 3: 1.0})


def test_check_row_passes_an_exact_resume():
    row = check.check_row("core_v0.16.1", "pretrain_gpt_dsv.sh", _logs(), 10, 20)
    assert row["ok"] and row["problems"] == "", row["problems"]
    assert all(not isinstance(v, (list, dict)) for v in row.values())  # flat, as DESIGN.md section 6 asks
    assert row["max_rel_diff_resumed"] < 1e-6 and row["stage2_sparse_layers"] == 2 and row["resumed_at"] == 10
    for key in ("tag", "script", "iterations", "stage2_sparse_layers", "resumed_at", "max_rel_diff_resumed",
                "max_rel_diff_two_uninterrupted", "ok"):
        assert key in row


def test_check_row_without_the_carry_fix_would_fail():
    """Comparing printed values would flag iteration 12 of an exact resume: the parser must undo it."""
    logs = _logs()
    a = check.parse_log(logs["a"])["printed"]
    resumed = check.parse_log(logs["resumed"])["printed"]
    assert abs(a[12] - resumed[12]) / a[12] > 1e-3  # what was once reported as a resume bug


def test_check_row_catches_a_resumed_curve_that_differs_at_one_iteration():
    bad = dict(TRUE)
    bad[13] *= 1.01
    row = check.check_row("core_v0.16.1", "pretrain_gpt_dsv.sh", _logs(bad), 10, 20)
    assert not row["ok"] and row["worst_iteration_resumed"] == 13
    assert "resumed curve differs" in row["problems"]


def test_check_row_names_missing_runs_and_missing_dsv():
    logs = _logs(dsv=False)
    logs["resumed"] = ""
    row = check.check_row("core_v0.19.0", "pretrain_video_dit.py", logs, 10, 20)
    assert not row["ok"]
    text = row["problems"]
    assert "did not resume" in text and "no [dsv] log lines" in text
    logs = _logs()
    logs["resumed"] = _log(TRUE, range(1, 21))  # started from scratch instead of resuming
    assert "did not resume" in check.check_row("t", "s", logs, 10, 20)["problems"]


def test_compare_and_write_commands(tmp_path, monkeypatch):
    for name, text in _logs().items():
        (tmp_path / f"{name}.log").write_text(text)
    rows = tmp_path / "rows.jsonl"
    argv = ["compare", "--tag", "core_v0.16.1", "--script", "pretrain_gpt_dsv.sh", "--rows", str(rows),
            "--resumed-at", "10", "--iterations", "20"]
    for flag, name in (("--run-a", "a"), ("--run-b", "b"), ("--first", "first"), ("--resumed", "resumed")):
        argv += [flag, str(tmp_path / f"{name}.log")]
    assert check.main(argv + ["--megatron-core", "0.16.1"]) == 0
    assert check.main(argv[:-1] + [str(tmp_path / "absent.log")]) == 1  # a run that never wrote a log
    monkeypatch.setenv("DSV_RESULTS_DIR", str(tmp_path / "unused"))
    assert check.main(["write", "--rows", str(rows), "--out", str(tmp_path / "out")]) == 1  # one row failed
    (path,) = (tmp_path / "out").glob("megatron_lm-*-*.json")
    data = json.loads(path.read_text())
    assert set(data) == {"meta", "rows"} and [r["ok"] for r in data["rows"]] == [True, False]
    assert {"gpu", "torch", "megatron_core", "date", "commit"} <= set(data["meta"])
    assert data["rows"][0]["megatron_core"] == "0.16.1" and "megatron_core" not in data["rows"][1]  # the tree's


def test_fusion_flags_for_each_environment():
    none = {k: False for k in ("transformer_engine", "apex", "fused_weight_gradient_mlp_cuda",
                               "scaled_masked_softmax_cuda")}
    stock = [f for f, _ in fusion.fusion_flags(none)]
    assert stock == ["--transformer-impl=local", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
                     "--no-masked-softmax-fusion", "--no-persist-layer-norm"]
    assert fusion.fusion_flags({k: True for k in none}) == []
    te_only = [f for f, _ in fusion.fusion_flags({**none, "transformer_engine": True})]
    assert te_only == ["--no-masked-softmax-fusion", "--no-persist-layer-norm"]
    apex_only = [f for f, _ in fusion.fusion_flags({**none, "apex": True, "fused_weight_gradient_mlp_cuda": True,
                                                    "scaled_masked_softmax_cuda": True})]
    assert apex_only == ["--transformer-impl=local", "--no-rope-fusion"]
    assert fusion.available(lambda name: name == "apex")["apex"] is True


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="needs shellcheck")
@pytest.mark.parametrize("script", ["tools/gpu_megatron_lm_check.sh", "examples/megatron_lm/pretrain_gpt_dsv.sh",
                                    "examples/video_dit/pretrain_video_dit.sh"])
def test_shellcheck(script):
    proc = subprocess.run(["shellcheck", "-x", os.path.join(ROOT, script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_gpu_check_dry_run_names_every_run(tmp_path):
    """DRY_RUN=1 on one tag: the four runs of each script, the interrupted one with --exit-interval 10,
    the same checkpoint folder for its two parts; a missing tarball is a FAIL line, never a hang."""
    shared = os.path.join(os.path.dirname(ROOT), "shared", "megatron-lm")  # CI's copy of shared/ beside the clone
    folder = os.environ.get("MEGATRON_LM_TARBALLS") or (shared if os.path.isdir(shared) else os.path.join(ROOT, ".mlm"))
    mlm = os.path.join(folder, "Megatron-LM-core_v0.16.1.tgz")
    env = {**os.environ, "DRY_RUN": "1"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_megatron_lm_check.sh"), str(tmp_path / "out"),
                           "core_v9.9.9"], capture_output=True, text=True, env=env, timeout=120)
    assert "FAIL core_v9.9.9" in proc.stdout and ".mlm/Megatron-LM-core_v9.9.9.tgz is missing" in proc.stdout
    if not os.path.exists(mlm):
        pytest.skip(f"{mlm} absent (../shared/megatron-lm/ or .mlm/ holds the tarballs for the full dry run)")
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_megatron_lm_check.sh"), str(tmp_path / "out"),
                           "core_v0.16.1"], capture_output=True, text=True, env={**env, "MLM_TARBALLS": folder},
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [line for line in proc.stdout.splitlines() if line.startswith("[core_v0.16.1-")]
    names = [line.split("]")[0][1:] for line in runs]
    assert sorted(names) == sorted(f"core_v0.16.1-{s}-{r}" for s in ("gpt", "video")
                                   for r in ("a", "b", "first", "resumed"))
    for line in runs:
        assert ("--exit-interval 10" in line) == ("-first]" in line)
        assert "LOG_INTERVAL=1" in line and "--dsv-sparsity-threshold" in line
    first = next(line for line in runs if "gpt-first]" in line)
    resumed = next(line for line in runs if "gpt-resumed]" in line)
    out_of = lambda line: line.split(" OUT=")[1].split()[0]  # noqa: E731
    assert out_of(first) == out_of(resumed)


@pytest.mark.parametrize("script,needs", [("examples/megatron_lm/pretrain_gpt_dsv.sh", "pretrain_gpt.py"),
                                          ("examples/video_dit/pretrain_video_dit.sh", "megatron/training")])
def test_launchers_name_what_is_missing(tmp_path, script, needs):
    """A folder that is no Megatron-LM checkout, an interpreter without megatron_dsv: one clear line, exit 2."""
    path = os.path.join(ROOT, script)
    env = dict(os.environ, MEGATRON_LM=str(tmp_path), PYTHON=sys.executable, OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", path], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and needs in proc.stderr and "a Megatron-LM checkout is needed" in proc.stderr
    (tmp_path / "pretrain_gpt.py").write_text("")
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "training.py").write_text("")
    bare = tmp_path / "bare-python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")  # no site-packages: no torch, no megatron_dsv
    bare.chmod(0o755)
    proc = subprocess.run(["bash", path], env=dict(env, PYTHON=str(bare)), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "cannot import: torch" in proc.stderr and "megatron_dsv" in proc.stderr


@pytest.mark.parametrize("script", ["examples/megatron_lm/pretrain_gpt_dsv.sh", "examples/video_dit/pretrain_video_dit.sh"])
def test_launchers_pass_eval_and_fusion_flags(tmp_path, script):
    """core_v0.16.1 needs --eval-interval (None there is a TypeError) and, without TE/apex, the fusion flags."""
    env = dict(os.environ, MEGATRON_LM=str(tmp_path), PYTHON=sys.executable, DSV_DRY_RUN="1", NPROC="1",
               EVAL_INTERVAL="7", EVAL_ITERS="3")
    proc = subprocess.run(["bash", os.path.join(ROOT, script), "--seed", "5"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout
    assert "--eval-interval 7 --eval-iters 3" in cmd and cmd.rstrip().endswith("--seed 5")
    for flag, _ in fusion.fusion_flags(fusion.available()):
        assert flag in cmd
    off = subprocess.run(["bash", os.path.join(ROOT, script)], env=dict(env, FUSION_FLAGS="0"), capture_output=True,
                         text=True, timeout=60)
    assert "--no-persist-layer-norm" not in off.stdout and "--transformer-impl" not in off.stdout
