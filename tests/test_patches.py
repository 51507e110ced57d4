"""The Megatron-LM patch sets (patches/megatron-lm/core_v0.16.1, core_v0.19.0) and tools/apply_patches.py.

* every patch parses (``git apply --numstat``), touches exactly the files patches/README.md names
  for it, adds at most a few lines and removes none;
* what each patch adds behaves as intended, run on its own against megatron_dsv (no Megatron-LM
  needed): flags added once and a clear error without megatron_dsv; the DSV spec when
  --use-dsv-attention is set; the step-end hook after successful steps only;
* apply_patches.py on synthetic repos made of the patches' pre-images: apply, idempotent re-apply,
  --check, revert, and each refusal (not a repo, wrong version, dirty tree, patches that do not apply);
* on the real trees (``../shared/megatron-lm/Megatron-LM-<tag>.tgz``, unpacked once per session by the
  ``megatron_lm_tree`` fixture, or ``MEGATRON_LM_DIR``): the full round trip on a scratch clone, with
  every patched file byte-compiled; skipped when absent;
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

# The series of each tag and the files each patch may touch (patches/README.md lists the same).
_COMMON = {
    "0001-dsv-arguments.patch": ["megatron/training/arguments.py"],
    "0002-dsv-gpt-layer-spec.patch": ["gpt_builders.py"],
    "0003-dsv-step-end-hook.patch": ["megatron/training/training.py"],
}
_PREFETCH = {"0005-dsv-step-end-prefetch.patch": ["megatron/training/training.py"]}
SERIES = {
    "core_v0.16.1": {**_COMMON, **_PREFETCH},
    # core_v0.19's pretrain_gpt.py builds its model from gpt_config_from_args, not gpt_builder
    "core_v0.19.0": {**_COMMON, "0004-dsv-gpt-config-layer-spec.patch": ["megatron/training/argument_utils.py"],
                     **_PREFETCH},
}
EXPECTED = SERIES["core_v0.16.1"]
TAGS = list(SERIES)
MAX_CHANGED_LINES = 40

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")


def _load_tool():
    spec = importlib.util.spec_from_file_location("apply_patches_under_test", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tool():
    """A fresh copy of the tool module (tests may re-pin PINNED on it)."""
    return _load_tool()


def _patch(name, tag="core_v0.16.1"):
    return os.path.join(_load_tool().patch_dir_for(tag), name)


def _git(repo, *args, check=True):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=check)


def _run_tool(tool, argv, capsys):
    code = tool.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- the patch files -------------------------------------------------------------------------
def test_series_is_the_expected_one(tool):
    assert list(tool.PINNED) == TAGS and tool.PINNED_TAG == TAGS[0]
    for tag in TAGS:
        assert [os.path.basename(p) for p in tool.patch_files(tool.patch_dir_for(tag))] == list(SERIES[tag])
        assert re.fullmatch(r"[0-9a-f]{40}", tool.PINNED[tag])
    assert os.path.basename(tool.PATCH_DIR) == tool.PINNED_TAG


@pytest.mark.parametrize("tag,name", [(t, n) for t in TAGS for n in SERIES[t]])
def test_patch_parses_is_small_and_touches_named_files(tag, name, tmp_path, tool):
    path = _patch(name, tag)
    # git parses the patch (outside any repository) and counts its lines per file
    proc = subprocess.run(["git", "apply", "--numstat", path], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("\t") for line in proc.stdout.splitlines()]
    assert [r[2] for r in rows] == SERIES[tag][name] == tool.touched_files(path)
    added, removed = sum(int(r[0]) for r in rows), sum(int(r[1]) for r in rows)
    assert 0 < added + removed < MAX_CHANGED_LINES, f"{name}: {added} added, {removed} removed"
    assert removed == 0, f"{name} removes upstream lines: patches only add calls into megatron_dsv"
    text = open(path, encoding="utf-8").read()
    assert "megatron_dsv" in text and "use_dsv_attention" in text.replace("-", "_")


@pytest.mark.parametrize("name", list(_COMMON) + list(_PREFETCH))
def test_both_tags_add_the_same_lines(name):
    """One behaviour for both pins: the series differ only in context (and 0.19's extra 0004)."""
    assert _added_code(name, "core_v0.16.1") == _added_code(name, "core_v0.19.0")


def test_readme_names_each_patch_and_its_files():
    text = open(README, encoding="utf-8").read()
    for tag in TAGS:
        assert f"`{tag}`" in text, f"patches/README.md must name {tag}"
    rows = {line.split("|")[1].strip(" `"): line for line in text.splitlines() if line.startswith("| `0")}
    every = dict(sorted((name, files) for tag in TAGS for name, files in SERIES[tag].items()))
    assert list(rows) == list(every), "patches/README.md's table must list the series in order"
    for name, files in every.items():
        assert [f for f in files if f"`{f}`" in rows[name]] == files, f"README's row for {name} must name {files}"
    assert "tools/apply_patches.py" in text and "--revert" in text and "--use-dsv-attention" in text


def _added_code(name, tag="core_v0.16.1"):
    """The lines a patch adds, dedented: runnable on their own for the behaviour tests below."""
    lines = [line[1:] for line in open(_patch(name, tag), encoding="utf-8").read().splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    return textwrap.dedent("\n".join(lines))


def _as_function(name, params, returns, tag="core_v0.16.1"):
    body = textwrap.indent(_added_code(name, tag), "    ")
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


def test_gpt_config_patch_sets_a_dsv_layer_spec_callable():
    """core_v0.19.0's 0004: gpt_config_from_args hands GPTModelConfig a callable spec (config, vp_stage)
    that wraps what Megatron would use (here a --spec ModuleSpec) with DSV core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_dsv.arguments import add_dsv_args
    from megatron_dsv.attention import DSVCoreAttention

    patched = _as_function("0004-dsv-gpt-config-layer-spec.patch", "args, kwargs", "kwargs", tag="core_v0.19.0")
    parser = add_dsv_args(argparse.ArgumentParser())
    spec = get_gpt_layer_local_spec()
    kwargs = patched(parser.parse_args(["--use-dsv-attention", "--dsv-theta", "0.7"]), {"transformer_layer_spec": spec})
    built = kwargs["transformer_layer_spec"](None, vp_stage=None)
    core = built.submodules.self_attention.submodules.core_attention
    assert core.module is DSVCoreAttention and core.params["dsv_config"].theta == 0.7
    seen = []

    def provider(config, vp_stage=None):  # a callable spec, as GPTModelConfig allows
        seen.append((config, vp_stage))
        return get_gpt_layer_local_spec()

    on = parser.parse_args(["--use-dsv-attention"])
    built = patched(on, {"transformer_layer_spec": provider})["transformer_layer_spec"]("CFG", vp_stage=1)
    assert seen == [("CFG", 1)] and built.submodules.self_attention.submodules.core_attention.module is DSVCoreAttention
    assert patched(parser.parse_args([]), {"transformer_layer_spec": spec}) == {"transformer_layer_spec": spec}
    assert patched(argparse.Namespace(), {}) == {}  # megatron_dsv absent: no flag at all


def test_step_end_patch_calls_hook_after_successful_steps(monkeypatch):
    import megatron_dsv.training.megatron_lm as integration

    calls = []
    monkeypatch.setattr(integration, "dsv_train_step_end",
                        lambda model, iteration, args: calls.append((model, iteration, args.use_dsv_attention)))
    for tag in TAGS:
        # the hook sees the iteration after its increment (steps completed), so nothing runs a step late
        text = open(_patch("0003-dsv-step-end-hook.patch", tag), encoding="utf-8").read()
        assert re.search(r"^ +iteration \+= 1\n\+", text, re.M), "the hook must follow 'iteration += 1'"
    step_end = _as_function("0003-dsv-step-end-hook.patch", "args, model, iteration, skipped_iter", "iteration")
    model = [torch.nn.Linear(2, 2)]  # Megatron passes its list of model chunks
    on = argparse.Namespace(use_dsv_attention=True)
    step_end(on, model, 7, 0)
    step_end(on, model, 8, 1)  # skipped (e.g. fp16 overflow): no optimizer step, no DSV step end
    step_end(argparse.Namespace(use_dsv_attention=False), model, 9, 0)
    step_end(argparse.Namespace(), model, 10, 0)  # megatron_dsv absent: no flag at all
    assert calls == [(model, 7, True)]


def test_step_end_integration_logs_a_dsv_line(monkeypatch, capsys):
    """dsv_train_step_end closes the DSV step with Megatron's iteration and prints the [dsv] line that
    tools/megatron_lm_check.py parses, on logging iterations only."""
    import megatron_dsv.attention as attention
    import megatron_dsv.training.megatron_lm as integration

    closed = []
    monkeypatch.setattr(attention, "dsv_on_step_end", lambda model, it, dp_group=None: closed.append(it) or 2)
    monkeypatch.setattr(attention, "dsv_layers", lambda model: ["l1", "l2"])
    monkeypatch.setattr(attention, "dsv_metrics", lambda model: {"dsv/stage": 2.0, "dsv/sparse_fraction": 0.5,
                                                                 "dsv/sparsity_mean": 0.9, "dsv/predictor_loss": 0.1})
    args = argparse.Namespace(log_interval=5)
    assert integration.dsv_train_step_end([], 4, args) == 2
    assert integration.dsv_train_step_end([], 5, args) == 2
    assert closed == [4, 5]
    out = capsys.readouterr().out.rstrip("\n").splitlines()
    assert out == [" [dsv] iteration        5 | stage 2 | sparse layers 1/2 | sparsity 0.900 | predictor loss 1.000E-01"]
    tool = importlib.util.spec_from_file_location("mlm_check", os.path.join(ROOT, "tools", "megatron_lm_check.py"))
    check = importlib.util.module_from_spec(tool)
    tool.loader.exec_module(check)
    assert check.parse_log(out[0])["dsv"] == {5: (2, 1, 2)}


def test_prefetch_patch_queues_the_step_end_right_before_the_optimizer_step(monkeypatch):
    """Patch 0005 calls dsv_train_step_prefetch(model, args) in train_step just before the optimizer step, under
    --use-dsv-attention only."""
    import megatron_dsv.training.megatron_lm as integration

    for tag in TAGS:
        text = open(_patch("0005-dsv-step-end-prefetch.patch", tag), encoding="utf-8").read()
        assert re.search(r"^\+ +dsv_train_step_prefetch\(model, args\).*\n(?: *\n)*.*\n +update_successful, grad_norm, "
                         r"num_zeros_in_grad = optimizer\.step\(\)", text, re.M), tag
    calls = []
    monkeypatch.setattr(integration, "dsv_train_step_prefetch", lambda model, args: calls.append((model, args)))
    prefetch = _as_function("0005-dsv-step-end-prefetch.patch", "args, model", "None")
    model, on = [torch.nn.Linear(2, 2)], argparse.Namespace(use_dsv_attention=True)
    prefetch(on, model)
    prefetch(argparse.Namespace(use_dsv_attention=False), model)
    prefetch(argparse.Namespace(), model)  # megatron_dsv absent: no flag at all
    assert calls == [(model, on)]


def test_patched_step_with_prefetch_is_the_same_step(megatron_cpu, fast_table):
    """Patches 0005 + 0003 around an optimizer step (Megatron's list of chunks) leave the same weights, DSV state
    and stages, bit for bit, as 0003 alone; with a loss scaler (--fp16, --loss-scale) nothing is queued, since a
    skipped step gets no step end."""
    from megatron_dsv.attention import dsv_layers
    from megatron_dsv.training.megatron_lm import dsv_train_step_prefetch
    from tests.attention.conftest import dsv_config
    from tests.attention.test_block import _block

    prefetch = _as_function("0005-dsv-step-end-prefetch.patch", "args, model", "None")
    step_end = _as_function("0003-dsv-step-end-hook.patch", "args, model, iteration, skipped_iter", "iteration")

    def run(with_prefetch, steps=4, **flags):
        args = argparse.Namespace(**{**dict(use_dsv_attention=True, log_interval=100, fp16=False, loss_scale=None),
                                     **flags})
        cfg = dsv_config(stage_switch_rule="steps", stage_switch_steps=2, sparsity_threshold=0.0,
                         speedup_table=fast_table, granularity="block", kv_block_size=64)
        torch.manual_seed(0)
        model = [_block(cfg)]
        opt = torch.optim.SGD(model[0].parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        queued = []
        for iteration in range(steps):
            x = torch.randn(256, 2, 128, generator=gen)
            model[0](hidden_states=x, attention_mask=None).square().mean().backward()
            if with_prefetch:
                prefetch(args, model)
                queued.append(getattr(model[0], "_dsv_step_end_read", None) is not None)
            opt.step()
            opt.zero_grad()
            step_end(args, model, iteration + 1, 0)
        return model[0], queued

    plain, _ = run(False)
    early, queued = run(True)
    assert queued == [True] * 4
    a, b = plain.state_dict(), early.state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a if torch.is_tensor(a[n]))
    assert [(x.stage_host, x.step_host) for x in dsv_layers(early)] == [(2, 4)] * len(dsv_layers(early))
    for flags in (dict(fp16=True), dict(loss_scale=4096.0)):
        _, queued = run(True, steps=2, **flags)
        assert queued == [False, False], flags
    assert dsv_train_step_prefetch([], argparse.Namespace(fp16=False)) is False  # a rank without chunks


# ---- apply_patches.py on synthetic repositories ---------------------------------------------
def _preimages(tag="core_v0.16.1"):
    """{path: text} holding, for every hunk, its context and removed lines: enough for git apply,
    which finds hunks at any offset."""
    files = {}
    for name in SERIES[tag]:
        current = None
        for line in open(_patch(name, tag), encoding="utf-8").read().splitlines():
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
    """A synthetic repo the tool accepts as core_v0.16.1 (PINNED re-pinned to its HEAD)."""
    repo, files = _synthetic_repo(tmp_path / "mlm")
    tool.PINNED["core_v0.16.1"] = _git(repo, "rev-parse", "HEAD").stdout.strip()
    return repo, files


def test_help_documents_usage_and_exit_codes():
    proc = subprocess.run([sys.executable, TOOL, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    for word in ("MEGATRON_LM_DIR", "--revert", "--check", "--tag", "exit codes", "core_v0.16.1", "core_v0.19.0",
                 "dirty"):
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
    assert f"found {tag} (commit {head})" in err
    assert f"expected core_v0.16.1 (commit {tool.PINNED['core_v0.16.1']}) or core_v0.19.0" in err
    assert _status(repo) == [""]


def test_tag_flag_insists_on_one_pin(pinned_repo, tool, capsys):
    repo, _ = pinned_repo
    code, _, err = _run_tool(tool, [repo, "--tag", "core_v0.19.0"], capsys)
    assert code == 3 and "expected core_v0.19.0 (commit" in err and "or core_v0.16.1" not in err
    code, _, err = _run_tool(tool, [repo, "--tag", "core_v0.18.0"], capsys)
    assert code == 2 and "--tag must be one of core_v0.16.1, core_v0.19.0; got 'core_v0.18.0'" in err
    assert _status(repo) == [""]


def test_the_tag_picks_its_series(tmp_path, tool, capsys):
    """A repo at core_v0.19.0's commit gets the 0.19.0 series (four patches) without being told."""
    repo, _ = _synthetic_repo(tmp_path / "mlm19", tag="core_v0.19.0", files=_preimages("core_v0.19.0"))
    tool.PINNED["core_v0.19.0"] = _git(repo, "rev-parse", "HEAD").stdout.strip()
    code, out, err = _run_tool(tool, [repo], capsys)
    assert code == 0 and f"applied {len(SERIES['core_v0.19.0'])} patches on core_v0.19.0" in out, err
    assert "argument_utils.py" in out


def test_apply_check_reapply_and_revert(pinned_repo, tool, capsys):
    repo, files = pinned_repo
    code, out, _ = _run_tool(tool, [repo, "--check"], capsys)
    assert code == 0 and "would apply cleanly" in out and _status(repo) == [""]
    code, out, _ = _run_tool(tool, [repo], capsys)
    assert code == 0 and f"applied {len(SERIES['core_v0.16.1'])} patches" in out
    for name, paths in EXPECTED.items():
        assert name in out
        for rel in paths:
            assert _added_code(name).splitlines()[0].strip() in (repo / rel).read_text()
    assert sorted(line[3:] for line in _status(repo) if line) == sorted(set(sum(EXPECTED.values(), [])))
    code, out, _ = _run_tool(tool, [repo], capsys)
    assert code == 0 and "already patched" in out
    code, out, _ = _run_tool(tool, [repo, "--revert"], capsys)
    assert code == 0 and f"reverted {len(EXPECTED)} patches" in out and _status(repo) == [""]
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
    tool.PINNED["core_v0.16.1"] = _git(repo, "rev-parse", "HEAD").stdout.strip()
    code, _, err = _run_tool(tool, [repo], capsys)
    assert code == 5 and "do not apply cleanly" in err and "gpt_builders.py" in err
    assert _status(repo) == [""]  # git apply is atomic: the patches that would apply did not either


# ---- the real Megatron-LM trees -------------------------------------------------------------
def _real_source(tag, tool, megatron_lm_tree):
    source = os.environ.get("MEGATRON_LM_DIR")
    if source and _git(source, "cat-file", "-e", tool.PINNED[tag] + "^{commit}", check=False).returncode == 0:
        return source
    return megatron_lm_tree(tag)  # skips, naming the tarball, when it is absent


@pytest.mark.parametrize("tag", TAGS)
def test_round_trip_on_real_megatron_lm(tag, tmp_path, tool, capsys, megatron_lm_tree):
    source = _real_source(tag, tool, megatron_lm_tree)
    repo = tmp_path / "mlm"  # a scratch clone sharing the objects: the source tree is never modified
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", source, str(repo)], check=True)
    _git(repo, "-c", "advice.detachedHead=false", "checkout", "-q", tool.PINNED[tag])
    pristine = {rel: (repo / rel).read_bytes() for paths in SERIES[tag].values() for rel in paths}

    code, out, err = _run_tool(tool, [repo, "--check"], capsys)
    assert code == 0 and f"{tag}; the {len(SERIES[tag])} patches would apply cleanly" in out, err
    code, out, err = _run_tool(tool, [repo], capsys)
    assert code == 0 and f"applied {len(SERIES[tag])} patches on {tag}" in out, err
    for rel in pristine:
        text = (repo / rel).read_text()
        assert "megatron_dsv" in text
        ast.parse(text, filename=rel)
        py_compile.compile(str(repo / rel), cfile=str(tmp_path / "pyc" / (rel + "c")), doraise=True)
    other = next(t for t in TAGS if t != tag)
    code, _, err = _run_tool(tool, [repo, "--tag", other], capsys)
    assert code == 3 and f"found {tag}" in err
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
