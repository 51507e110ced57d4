"""megatron-core 0.19 on the CPU: the plugin's model, attention, Wan and trainer tests against the megatron.core
that Megatron-LM core_v0.19.0 carries (0.19.1; ../shared/megatron-lm/, unpacked once per session), in a
subprocess whose PYTHONPATH puts that tree first. Left out there (``DESELECT``): the 30 Adam steps of the tiny
video DiT (0.19's layers train on the H200 instead: tools/gpu_megatron_lm_check.sh) and the 4-rank CP worlds (the
2-rank worlds make the same calls).

The suite itself runs on the megatron-core wheel CI installs (0.16.1, the newest for Python 3.11). core_v0.19.0's
megatron.core imports on Python 3.11, its megatron.training does not (it needs 3.12's ``typing.override``), so
Megatron-LM's training loop at that tag is checked on the H200 only (tools/gpu_megatron_lm_check.sh).
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# what changed between 0.16 and 0.19 reaches these: the layer spec checks (qk_layernorm against spec norms),
# the arguments TransformerLayer passes its attentions (name=), checkpoints, CP, the trainer's resume
SUBSET = ["tests/models", "tests/attention/test_local_lists.py", "tests/attention/test_block.py",
          "tests/training/test_pretrained_wan.py", "tests/training/test_resume_rules.py",
          "tests/parallel/test_cp_attention.py"]
# costly beside what they add on 0.19 (the module's doc)
DESELECT = ["tests/models/test_flow_and_sampling.py::test_tiny_loss_decreases_with_adam",
            "tests/parallel/test_cp_attention.py::test_core_attention_under_cp_matches_one_process[4]",
            "tests/parallel/test_cp_attention.py::test_cp_attention_every_layout_matches_one_process[4]"]


@pytest.mark.timeout(900)
def test_plugin_tests_pass_on_megatron_core_0_19(megatron_lm_tree):
    tree = megatron_lm_tree("core_v0.19.0")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, ROOT, os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    version = subprocess.run([sys.executable, "-c", "import megatron.core as m; print(m.__version__, m.__file__)"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert version.returncode == 0, version.stderr[-3000:]
    assert version.stdout.startswith("0.19.") and version.stdout.split()[1].startswith(tree), version.stdout
    deselect = [a for nodeid in DESELECT for a in ("--deselect", nodeid)]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *SUBSET, *deselect],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
    # the ids still exist
    assert re.search(rf"\b{len(DESELECT)} deselected", proc.stdout.splitlines()[-1]), proc.stdout[-2000:]
