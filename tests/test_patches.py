"""The Megatron-LM patch set (patches/megatron-lm/core_v0.16.1) and tools/apply_patches.py.

* every patch parses (``git apply --numstat``), touches exactly the files patches/README.md names
  for it, adds at most a few lines and removes none;
* what each patch adds behaves as intended, run on its own against megatron_dsv (no Megatron-LM
  needed): flags added once and a clear error without megatron_dsv; the DSV spec when
  --use-dsv-attention is set; the step-end hook after successful steps only;
* apply_patches.py on synthetic repos made of the patches' pre-images: apply, idempotent re-apply,
  --check, revert, and each refusal (not a repo, wrong version, dirty tree, patches that do not apply);
* with ``MEGATRON_LM_DIR`` (a Megatron-LM clone holding tag core_v0.16.1): the full round trip on a
  scratch clone, with every patched file byte-compiled; skipped otherwise;
* the reason no checkpoint patch exists: DSV state is in a GPT model's sharded_state_dict.
"""

import argparse
import ast
import importlib.util
import os
import py_compile
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "apply_patches.py")
README = os.path.join(ROOT, "patches", "README.md")

# The series and the files each patch may touch (patches/README.md lists the same).
EXPECTED = {
    "0001-dsv-arguments.patch": ["megatron/training/arguments.py"],
    "0002-dsv-gpt-layer-spec.patch": ["gpt_builders.py"],
    "0003-dsv-step-end-hook.patch": ["megatron/training/training.py"],
}
MAX_CHANGED_LINES = 40

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")


def _load_tool():
    spec = importlib.util.spec_from_file_location("apply_patches_under_test", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tool():
    """A fresh copy of the tool module (tests may re-pin PINNED_COMMIT on it)."""
    return _load_tool()


def _patch(name):
    return os.path.join(_load_tool().PATCH_DIR, name)


def _git(repo, *args, check=True):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=check)


def _run_tool(tool, argv, capsys):
    code = tool.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- the patch files -------------------------------------------------------------------------
def test_series_is_the_expected_one(tool):
    assert [os.path.basename(p) for p in tool.patch_files()] == list(EXPECTED)
    assert os.path.basename(tool.PATCH_DIR) == tool.PINNED_TAG == "core_v0.16.1"
    assert re.fullmatch(r"[0-9a-f]{40}", tool.PINNED_COMMIT)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_patch_parses_is_small_and_touches_named_files(name, tmp_path, tool):
    path = _patch(name)
    # git parses the patch (outside any repository) and counts its lines per file
    proc = subprocess.run(["git", "apply", "--numstat", path], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("\t") for line in proc.stdout.splitlines()]
    assert [r[2] for r in rows] == EXPECTED[name] == tool.touched_files(path)
    added, removed = sum(int(r[0]) for r in rows), sum(int(r[1]) for r in rows)
    assert 0 < added + removed < MAX_CHANGED_LINES, f"{name}: {added} added, {removed} removed"
    assert removed == 0, f"{name} removes upstream lines: patches only add calls into megatron_dsv"
    text = open(path, encoding="utf-8").read()
    assert "megatron_dsv" in text and "use_dsv_attention" in text.replace("-", "_")


def test_readme_names_each_patch_and_its_files():
    text = open(README, encoding="utf-8").read()
    rows = {line.split("|")[1].strip(" `"): line for line in text.splitlines() if line.startswith("| `0")}
    assert list(rows) == list(EXPECTED), "patches/README.md's table must list the series in order"
    for name, files in EXPECTED.items():
        assert [f for f in files if f"`{f}`" in rows[name]] == files, f"README's row for {name} must name {files}"
    assert "tools/apply_patches.py" in text and "--revert" in text and "--use-dsv-attention" in text


def _added_code(name):
    """The lines a patch adds, dedented: runnable on their own for the behaviour tests below."""
    lines = [line[1:] for line in open(_patch(name), encoding="utf-8").read().splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    return textwrap.dedent("\n".join(lines))


def _as_function(name, params, returns):
    body = textwrap.indent(_added_code(name), "    ")
    namespace = {}
    exec(f"def patched({params}):\n{body}\n    return {returns}\n", namespace)  # noqa: S102
    return namespace["patched"]


# ---- what the patches add, run on their own -------------------------------------------------
def test_arguments_patch_adds_dsv_flags_once(monkeypatch):
    from megatron_dsv.arguments import add_dsv_args

    add_flags = _as_function("0001-dsv-arguments.patch", "parser", "parser")
    parser = add_flags(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["--use-dsv-attention", "--dsv-theta", "0.8"])
    assert args.use_dsv_attention and args.dsv_theta == 0.8
    # a script that already passes add_dsv_args as extra_args_provider: no duplicate-flag error
    again = add_flags(add_dsv_args(argparse.ArgumentParser(allow_abbrev=False)))
    assert again.parse_args([]).use_dsv_attention is False


def test_arguments_patch_without_megatron_dsv(monkeypatch):
    add_flags = _as_function("0001-dsv-arguments.patch", "parser", "parser")
    monkeypatch.setitem(sys.modules, "megatron_dsv.arguments", None)  # import now raises ImportError
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2"])
    parser = add_flags(argparse.ArgumentParser(allow_abbrev=False))  # not asked for: stock Megatron
    assert "--use-dsv-attention" not in parser.format_help()
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--use-dsv-attention"])
    with pytest.raises(ImportError, match="--use-dsv-attention needs the megatron_dsv package"):
        add_flags(argparse.ArgumentParser(allow_abbrev=False))


def test_gpt_builder_patch_selects_dsv_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_dsv.arguments import add_dsv_args
    from megatron_dsv.attention import DSVCoreAttention

    select = _as_function("0002-dsv-gpt-layer-spec.patch", "args, transformer_layer_spec", "transformer_layer_spec")
    parser = add_dsv_args(argparse.ArgumentParser())
    on = select(parser.parse_args(["--use-dsv-attention", "--dsv-theta", "0.75"]), get_gpt_layer_local_spec())
    core = on.submodules.self_attention.submodules.core_attention
    assert core.module is DSVCoreAttention and core.params["dsv_config"].theta == 0.75
    off = select(parser.parse_args([]), get_gpt_layer_local_spec())
    assert off.submodules.self_attention.submodules.core_attention is DotProductAttention
    stock = select(argparse.Namespace(), get_gpt_layer_local_spec())  # megatron_dsv absent: no flag at all
    assert stock.submodules.self_attention.submodules.core_attention is DotProductAttention


def test_step_end_patch_calls_hook_after_successful_steps(monkeypatch):
    import megatron_dsv.attention as attention

    calls = []
    monkeypatch.setattr(attention, "dsv_on_step_end", lambda model, iteration: calls.append((model, iteration)))
    # the hook sees the iteration after its increment (steps completed), so nothing runs a step late
    text = open(_patch("0003-dsv-step-end-hook.patch"), encoding="utf-8").read()
    assert re.search(r"^ +iteration \+= 1\n\+", text, re.M), "the hook must follow 'iteration += 1'"
    step_end = _as_function("0003-dsv-step-end-hook.patch", "args, model, iteration, skipped_iter", "iteration")
    model = [torch.nn.Linear(2, 2)]  # Megatron passes its list of model chunks
    on = argparse.Namespace(use_dsv_attention=True)
    step_end(on, model, 7, 0)
    step_end(on, model, 8, 1)  # skipped (e.g. fp16 overflow): no optimizer step, no DSV step end
    step_end(argparse.Namespace(use_dsv_attention=False), model, 9, 0)
    step_end(argparse.Namespace(), model, 10, 0)  # megatron_dsv absent: no flag at all
    assert calls == [(model, 7)]


# ---- apply_patches.py on synthetic repositories ---------------------------------------------
def _preimages():
    """{path: text} holding, for every hunk, its context and removed lines: enough for git apply,
    which finds hunks at any offset."""
    files = {}
    for name in EXPECTED:
        current = None
        for line in open(_patch(name), encoding="utf-8").read().splitlines():
            m = re.match(r"^diff --git a/\S+ b/(\S+)$", line)
            if m:
                current = m.group(1)
                files.setdefault(current, [])
            elif line.startswith("@@"):
                files[current].append("# --- unrelated upstream code ---")
            elif current and line[:1] in (" ", "-") and not line.startswith("---"):
                files[current].append(line[1:])
    return {path: "\n".join(lines) + "\n" for path, lines in files.items()}


def _synthetic_repo(path, tag="core_v0.16.1", files=None):
    path.mkdir()
    _git(path, "init", "-q")
    files = dict(_preimages() if files is None else files)
    files["README.md"] = "synthetic Megatron-LM\n"
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    _git(path, "add", "-A")
    _git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "pre-images")
    _git(path, "tag", tag)
    return path, files


def _status(repo):
    return _git(repo, "status", "--porcelain", "--untracked-files=no").stdout.split("\n")


@pytest.fixture
def pinned_repo(tmp_path, tool):
    """A synthetic repo the tool accepts as core_v0.16.1 (PINNED_COMMIT re-pinned to its HEAD)."""
    repo, files = _synthetic_repo(tmp_path / "mlm")
    tool.PINNED_COMMIT = _git(repo, "rev-parse", "HEAD").stdout.strip()
    return repo, files


def test_help_documents_usage_and_exit_codes():
    proc = subprocess.run([sys.executable, TOOL, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    for word in ("MEGATRON_LM_DIR", "--revert", "--check", "exit codes", "core_v0.16.1", "dirty"):
        assert word in proc.stdout


def test_not_a_git_repo(tmp_path, tool, capsys):
    code, _, err = _run_tool(tool, [tmp_path], capsys)
    assert code == 2 and "not a git work tree" in err


@pytest.mark.parametrize("tag", ["core_v0.16.0", "core_v0.16.1"])
def test_wrong_version_names_found_and_expected(tmp_path, tool, capsys, tag):
    repo, _ = _synthetic_repo(tmp_path / "mlm", tag=tag)  # a core_v0.16.1 tag on another commit is wrong too
    head = _git(repo, "rev-parse", "HEAD").stdout.strip()
    code, _, err = _run_tool(tool, [repo], capsys)
    assert code == 3
    assert f"found {tag} (commit {head})" in err and f"expected core_v0.16.1 (commit {tool.PINNED_COMMIT})" in err
    assert _status(repo) == [""]


def test_apply_check_reapply_and_revert(pinned_repo, tool, capsys):
    repo, files = pinned_repo
    code, out, _ = _run_tool(tool, [repo, "--check"], capsys)
    assert code == 0 and "would apply cleanly" in out and _status(repo) == [""]
    code, out, _ = _run_tool(tool, [repo], capsys)
    assert code == 0 and "applied 3 patches" in out
    for name, paths in EXPECTED.items():
        assert name in out
        for rel in paths:
            assert _added_code(name).splitlines()[0].strip() in (repo / rel).read_text()
    assert sorted(line[3:] for line in _status(repo) if line) == sorted(sum(EXPECTED.values(), []))
    code, out, _ = _run_tool(tool, [repo], capsys)
    assert code == 0 and "already patched" in out
    code, out, _ = _run_tool(tool, [repo, "--revert"], capsys)
    assert code == 0 and "reverted 3 patches" in out and _status(repo) == [""]
    for rel, text in files.items():
        assert (repo / rel).read_text() == text
    code, out, _ = _run_tool(tool, [repo, "--revert"], capsys)
    assert code == 0 and "nothing to revert" in out


def test_dirty_tree_is_refused_with_the_files_listed(pinned_repo, tool, capsys):
    repo, _ = pinned_repo
    (repo / "README.md").write_text("local edit\n")
    code, _, err = _run_tool(tool, [repo], capsys)
    assert code == 4 and "dirty tree" in err and "README.md" in err
    assert _status(repo) == [" M README.md", ""]  # nothing applied
    code, _, err = _run_tool(tool, [repo, "--revert"], capsys)
    assert code == 4 and "README.md" in err


def test_revert_needs_exactly_the_patched_state(pinned_repo, tool, capsys):
    repo, _ = pinned_repo
    assert _run_tool(tool, [repo], capsys)[0] == 0
    builder = repo / "gpt_builders.py"
    builder.write_text(builder.read_text() + "# a local edit inside a patched file\n")
    code, _, err = _run_tool(tool, [repo, "--revert"], capsys)
    assert code == 4 and "gpt_builders.py" in err and "patched state" in err
    assert "# a local edit" in builder.read_text()
    _git(repo, "add", "gpt_builders.py")  # staged edits count too
    assert _run_tool(tool, [repo, "--revert"], capsys)[0] == 4


def test_patches_that_do_not_apply_change_nothing(tmp_path, tool, capsys):
    files = _preimages()
    files["gpt_builders.py"] = "def gpt_builder(args):\n    pass\n"  # upstream moved on
    repo, _ = _synthetic_repo(tmp_path / "mlm", files=files)
    tool.PINNED_COMMIT = _git(repo, "rev-parse", "HEAD").stdout.strip()
    code, _, err = _run_tool(tool, [repo], capsys)
    assert code == 5 and "do not apply cleanly" in err and "gpt_builders.py" in err
    assert _status(repo) == [""]  # git apply is atomic: the patches that would apply did not either


# ---- the real Megatron-LM tree -------------------------------------------------------------
def test_round_trip_on_real_megatron_lm(tmp_path, tool, capsys):
    source = os.environ.get("MEGATRON_LM_DIR")
    if not source:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM clone holding tag core_v0.16.1 for the real round trip")
    if _git(source, "cat-file", "-e", tool.PINNED_COMMIT + "^{commit}", check=False).returncode != 0:
        pytest.skip(f"MEGATRON_LM_DIR={source} does not hold commit {tool.PINNED_COMMIT} (core_v0.16.1)")
    repo = tmp_path / "mlm"  # a scratch clone sharing the objects: MEGATRON_LM_DIR is never modified
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", source, str(repo)], check=True)
    _git(repo, "-c", "advice.detachedHead=false", "checkout", "-q", tool.PINNED_COMMIT)
    pristine = {rel: (repo / rel).read_bytes() for paths in EXPECTED.values() for rel in paths}

    code, out, err = _run_tool(tool, [repo, "--check"], capsys)
    assert code == 0, err
    code, out, err = _run_tool(tool, [repo], capsys)
    assert code == 0 and "applied 3 patches" in out, err
    for rel in pristine:
        text = (repo / rel).read_text()
        assert "megatron_dsv" in text
        ast.parse(text, filename=rel)
        py_compile.compile(str(repo / rel), cfile=str(tmp_path / "pyc" / (rel + "c")), doraise=True)
    code, out, err = _run_tool(tool, [repo, "--revert"], capsys)
    assert code == 0, err
    assert _status(repo) == [""]
    assert {rel: (repo / rel).read_bytes() for rel in pristine} == pristine


# ---- why there is no checkpoint patch ---------------------------------------------------------
def test_dsv_state_travels_in_gpt_sharded_state_dict(megatron_cpu):
    """Megatron-LM saves ``model.sharded_state_dict()`` (torch_dist) or ``state_dict`` (torch) and
    loads with ``load_state_dict``: DSVCoreAttention's state is in both, as ShardedTensors."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megatron_dsv.config import DSVConfig
    from megatron_dsv.models.specs import get_dsv_layer_spec

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=2, attention_dropout=0.0,
                            hidden_dropout=0.0, use_cpu_initialization=True)
    model = GPTModel(cfg, get_dsv_layer_spec(get_gpt_layer_local_spec(), DSVConfig()), vocab_size=64,
                     max_sequence_length=32, position_embedding_type="learned_absolute")
    dsv_keys = {k for k in model.state_dict() if ".core_attention." in k}
    for layer in range(2):
        prefix = f"decoder.layers.{layer}.self_attention.core_attention."
        for name in ("sparsity", "stage", "cp_plan_state", "predictor.wq", "predictor.wq_exp_avg"):
            assert any(k.startswith(prefix + name) for k in dsv_keys), prefix + name
    sharded = model.sharded_state_dict()
    assert dsv_keys <= set(sharded)
    assert all(isinstance(sharded[k], ShardedTensor) for k in dsv_keys)
