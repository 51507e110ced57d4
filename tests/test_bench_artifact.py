"""benchmarks/bench_artifact.py on a CPU: its argument checks and its loader (the timing itself needs a GPU and a
checkout of the DSV artifact, neither of which CI has)."""

import json
import textwrap

import pytest
import torch

from benchmarks import bench_artifact


def test_missing_artifact_names_the_flag_and_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--artifact-dir .*NetX-lab/DSV at branch ae"):
        bench_artifact.load_artifact(str(tmp_path))


def test_group_sizes_must_be_multiples_of_the_artifacts_tile():
    assert bench_artifact.check_groups([32, 64, 128]) == [32, 64, 128]
    with pytest.raises(ValueError, match=r"--groups: .*multiples of 32, got \[16, 48\]"):
        bench_artifact.check_groups([16, 32, 48])


def _write(root, body):
    path = root / bench_artifact.ARTIFACT_FILE
    path.parent.mkdir(parents=True)
    path.write_text(textwrap.dedent(body))


def test_loader_returns_the_files_autograd_function(tmp_path):
    _write(tmp_path, """
        class SparseGroupAttention:
            @staticmethod
            def apply(*args):
                return ("called", len(args))
    """)
    assert bench_artifact.load_artifact(str(tmp_path))(1, 2, 3) == ("called", 3)


def test_loader_rejects_a_file_of_another_version(tmp_path):
    _write(tmp_path, "attention = None\n")
    with pytest.raises(AttributeError, match="defines no SparseGroupAttention"):
        bench_artifact.load_artifact(str(tmp_path))


def test_main_checks_groups_before_loading(tmp_path):
    with pytest.raises(ValueError, match="--groups"):
        bench_artifact.main(["--artifact-dir", str(tmp_path), "--groups", "40"])


# one_row on a CPU: our op and the "artifact" are the naive twin (the artifact's argument order), the timer counts


def _artifact_like(shift_lists=False):
    from megatron_dsv.ops.sparse_attention.naive import sparse_attention_naive

    def apply(q, k, v, causal, sm_scale, kv_index, topk_per_head, group_size):
        assert causal is False and isinstance(sm_scale, float) and kv_index.dtype == torch.int32
        assert topk_per_head.shape == q.shape[:2] and int(topk_per_head.min()) % 256 == 0
        if shift_lists:  # an index bug: each group reads the next group's list
            kv_index = kv_index.roll(1, dims=2)
        return sparse_attention_naive(q, k, v, kv_index, topk_per_head, group_size, 0, sm_scale)
    return apply


def _ours(q, k, v, idx, cnt, G):
    from megatron_dsv.ops.sparse_attention.naive import sparse_attention_naive

    return sparse_attention_naive(q, k, v, idx, cnt, G)


def _counting_timer():
    calls = []

    def timer(fn):
        fn()
        calls.append(len(calls) + 1)
        return float(calls[-1])
    return timer


DENSE = {"ms_dense_fwd": 10.0, "ms_dense_bwd": 30.0}


def test_one_row_rounds_lists_checks_and_times_in_order():
    row = bench_artifact.one_row(_artifact_like(), 512, 32, 0.6, 64, 2, DENSE, device="cpu", dtype=torch.float32,
                                 timer=_counting_timer(), attention=_ours)
    assert "mismatch" not in row
    assert row["kept_keys_per_group"] == 256 and row["sparsity"] == 0.5 and row["sparsity_asked"] == 0.6
    assert max(row[f"rel_diff_{n}"] for n in ("out", "dq", "dk", "dv")) < 1e-5
    # the timer's calls: ours fwd 1, bwd 2, the artifact's fwd 3, bwd 4; > 1 means ours is faster
    assert (row["ms_ours_fwd"], row["ms_ours_bwd"], row["ms_artifact_fwd"], row["ms_artifact_bwd"]) == (1, 2, 3, 4)
    assert row["ours_vs_artifact_fwd"] == 3.0 and row["ours_vs_artifact_bwd"] == 2.0
    assert row["ours_vs_artifact_fwd_bwd"] == 7 / 3 and row["speedup_ours_vs_dense_fwd_bwd"] == 40 / 3


def test_one_row_does_not_time_kernels_that_disagree():
    row = bench_artifact.one_row(_artifact_like(shift_lists=True), 512, 32, 0.5, 64, 2, DENSE, device="cpu",
                                 dtype=torch.float32, timer=_counting_timer(), attention=_ours)
    assert "not timed" in row["mismatch"] and "ms_ours_fwd" not in row
    assert row["rel_diff_out"] > bench_artifact.MISMATCH_REL


def test_list_lengths_are_multiples_of_256():
    assert bench_artifact.artifact_keys(65536, 0.9) == 6656
    assert bench_artifact.artifact_keys(1024, 0.99) == 256
    with pytest.raises(ValueError, match="--seq-lens: .*multiple of 256, got 1000"):
        bench_artifact.artifact_keys(1000, 0.9)


def _call(path, gpu, date, S, G):
    row = dict(S=S, G=G, sparsity=0.9, ms_ours_fwd=1.0, ms_ours_bwd=2.0, ms_artifact_fwd=0.9, ms_artifact_bwd=6.0,
               ms_dense_fwd=3.0, ms_dense_bwd=9.0, speedup_ours_vs_dense_fwd_bwd=4.0,
               speedup_artifact_vs_dense_fwd_bwd=12.0 / 6.9, ours_vs_artifact_fwd=0.9, ours_vs_artifact_bwd=3.0,
               ours_vs_artifact_fwd_bwd=6.9 / 3.0)
    path.write_text(json.dumps(dict(meta=dict(gpu=gpu, date=date, commit="c" + date), rows=[row])))
    return str(path)


def test_join_keeps_each_calls_date_and_refuses_two_gpus(tmp_path):
    a = _call(tmp_path / "a.json", "NVIDIA H100 80GB HBM3", "d1", 65536, 32)
    b = _call(tmp_path / "b.json", "NVIDIA H100 80GB HBM3", "d2", 16384, 32)
    assert bench_artifact.main(["--join", a, b, "--out", str(tmp_path / "out")]) == 0
    (path,) = (tmp_path / "out").glob("artifact_compare-*.json")
    doc = json.loads(path.read_text())
    assert [(r["S"], r["call_date"]) for r in doc["rows"]] == [(65536, "d1"), (16384, "d2")]
    assert [j["date"] for j in doc["meta"]["joined_from"]] == ["d1", "d2"] and doc["meta"]["gpu"].startswith("NVIDIA")
    assert path.with_suffix(".png").stat().st_size > 10_000
    c = _call(tmp_path / "c.json", "NVIDIA H200", "d3", 65536, 64)
    with pytest.raises(ValueError, match="--join: the files name 2 GPUs"):
        bench_artifact.join([a, c], str(tmp_path / "out2"))


def test_timing_needs_the_artifact_dir_unless_joining():
    with pytest.raises(SystemExit, match="--artifact-dir is required"):
        bench_artifact.main(["--groups", "32"])
