"""Test set-up shared by every test.

Without a GPU, Triton kernels run under the interpreter: ``TRITON_INTERPRET``
must be set before the first ``import triton``, so it is set here.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the H200 device, not in CPU CI)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "slow: longer CPU tests")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the H200 device, not in CPU CI)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
