"""benchmarks/bench_artifact.py on a CPU: its argument checks and its loader (the timing itself needs a GPU and a
checkout of the DSV artifact, neither of which CI has)."""

import textwrap

import pytest

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
