"""The patched Megatron-LM (core_v0.16.1 from ../shared/megatron-lm/, unpacked once per session) on the CPU:
its own parse_args with every --dsv-* flag, gpt_builder choosing DSVCoreAttention, the step-end call of
patch 0003 with its [dsv] line, and DSV state through Megatron-LM's save_checkpoint/load_checkpoint.

One subprocess (tests/megatron_lm/mlm_cpu_script.py, ~15 s) runs it all, so Megatron-LM's global state never
reaches this test process. megatron.training needs a few packages megatron-core does not: six, regex,
pyyaml, pydantic (the ``megatron-lm`` extra of setup.py); without them the tests skip, naming them.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlm_cpu_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEEDED = {"six": "six", "regex": "regex", "yaml": "pyyaml", "pydantic": "pydantic"}


@pytest.fixture(scope="module")
def findings(megatron_lm_tree, tmp_path_factory):
    missing = [pkg for mod, pkg in NEEDED.items() if importlib.util.find_spec(mod) is None]
    if missing:
        pytest.skip(f"Megatron-LM's megatron.training needs {', '.join(missing)}: pip install {' '.join(missing)}")
    tree = megatron_lm_tree("core_v0.16.1", patched=True)
    out = tmp_path_factory.mktemp("mlm-cpu") / "findings.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, ROOT, os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, SCRIPT, str(out)], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_patched_parse_args_takes_every_dsv_flag(findings):
    assert len(findings["dsv_flags"]) >= 25  # every --dsv-* flag of megatron_dsv, spelled out
    assert findings["config_equal"], "Megatron-LM's parser must give the DSVConfig megatron_dsv's own parser gives"


def test_gpt_builder_chooses_the_dsv_spec(findings):
    assert findings["core_attention"] == ["DSVCoreAttention", "DSVCoreAttention"]
    assert findings["dsv_config_in_layers"]


def test_step_end_call_logs_each_iteration(findings):
    lines = findings["dsv_lines"]
    assert [int(line.split("iteration")[1].split("|")[0]) for line in lines] == [1, 2, 3]
    assert all("stage 1 | sparse layers 0/2" in line for line in lines)
    assert findings["prefetched"] == [True, True, True]  # Megatron-LM's bf16/fp32 args: no loss scaler


def test_dsv_state_through_megatron_lm_checkpoint_functions(findings):
    names = findings["dsv_tensors"]
    for name in ("step", "stage", "profiles", "sparsity", "budget_density", "predictor.wq", "predictor.wq_exp_avg",
                 "predictor.adam_steps"):
        assert any(n.endswith(".core_attention." + name) for n in names), name
    assert any(n.endswith(".step") for n in findings["differ_before_load"])  # a fresh model differs...
    assert any("predictor.wq" in n for n in findings["differ_before_load"])
    assert findings["differ_after_load"] == []  # ...and the loaded one holds every DSV tensor exactly
    assert findings["loaded_iteration"] == 3
    assert findings["host_mirrors"] == findings["host_mirrors_saved"] == [[3, 1, True], [3, 1, True]]
