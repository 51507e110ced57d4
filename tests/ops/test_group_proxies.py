"""The query groups' proxies: the Triton group-sum kernel gives the reference loop's sums bit for bit (the same
float32 additions in the same order), over odd shapes, partial last groups, signed zeros and strided inputs,
and a top-k call on the Triton backend issues a number of torch ops that does not grow with the group size.

Runs under the Triton interpreter on this CPU machine (fp32, fp16) and on CUDA (also bf16) when a GPU is present.
"""

import pytest
import torch

from benchmarks.host_ops import OpCounter
from megatron_dsv.ops.topk_estimation.naive import group_proxies, group_sums_loop
from megatron_dsv.ops.topk_estimation.triton_impl import estimate_topk_triton, group_sums

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("shape,G", [((1, 1, 1, 1), 1), ((2, 3, 130, 16), 32), ((1, 2, 301, 12), 128),
                                     ((3, 70, 5), 7), ((1, 1, 40, 16), 128), ((2, 2, 256, 32), 64)],
                         ids=["one", "partial-G32", "r12-partial-G128", "3d-G7", "G-over-S", "whole-G64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_group_sums_kernel_equals_loop(shape, G, dtype):
    g = torch.Generator().manual_seed(sum(shape) + G)
    q = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])
    q.view(-1)[::5] *= 1e-41  # subnormal (or flushed) values in every dtype: no flush-to-zero in the adds
    q = q.to(dtype).to(DEV)
    assert _bits_equal(group_sums(q, G), group_sums_loop(q, G))


def test_group_sums_signed_zeros_and_strides():
    """-0.0 tokens: a group of -0.0 sums to -0.0 when whole and to +0.0 when its padding adds +0.0, in both; a
    strided (transposed) input reads the same values."""
    q = torch.zeros(1, 2, 70, 8, device=DEV)
    q[0, 0] = -0.0
    q[0, 1, :35] = torch.randn(35, 8, generator=torch.Generator().manual_seed(1)).to(DEV)
    for G in (7, 32, 35):
        assert _bits_equal(group_sums(q, G), group_sums_loop(q, G)), G
    t = torch.randn(1, 8, 50, 2, generator=torch.Generator().manual_seed(2)).to(DEV).transpose(1, 3)  # [1, 2, 50, 8]
    assert not t.is_contiguous()
    assert _bits_equal(group_sums(t, 16), group_sums_loop(t.contiguous(), 16))
    v = torch.randn(2, 3, 90, 8, generator=torch.Generator().manual_seed(4)).to(DEV)[:, 1:, ::2, :]  # strided rows
    assert v.stride(-1) == 1 and v.stride(-2) == 16
    assert _bits_equal(group_sums(v, 7), group_sums_loop(v, 7))
    assert group_sums(torch.zeros(2, 0, 4, device=DEV), 8).shape == (2, 0, 4)  # empty: no launch


@pytest.mark.parametrize("proxy", ["mean", "middle"])
def test_group_proxies_kernel_and_loop_paths_agree(proxy):
    q = torch.randn(2, 3, 301, 16, generator=torch.Generator().manual_seed(3)).to(torch.float16).to(DEV)
    a = group_proxies(q, 32, proxy, kernel=True)
    b = group_proxies(q, 32, proxy, kernel=False)
    assert a.dtype == q.dtype and torch.equal(a, b)


def test_triton_topk_op_count_does_not_grow_with_group_size():
    """The proxies were G - 1 elementwise adds a call (127 at G=128, each a kernel launch on the GPU, which left
    the DSV step host-bound); with the kernel the call's torch ops do not depend on G."""
    counts = {}
    for G in (16, 128):
        q = torch.randn(1, 2, 512, 16, generator=torch.Generator().manual_seed(G)).to(DEV)
        k = torch.randn(1, 2, 512, 16, generator=torch.Generator().manual_seed(G + 1)).to(DEV)
        # a training step's count: caches keyed by the shape (group_lengths, ...) filled by a first call, as by
        # step 1 (or by an earlier test in this process, which made the count depend on the tests' order)
        estimate_topk_triton(q, k, torch.tensor([2, 3]), G, 128, method="gemm")
        with OpCounter() as oc:
            estimate_topk_triton(q, k, torch.tensor([2, 3]), G, 128, method="gemm")
        counts[G] = sum(oc.ops.values())
    assert counts[128] == counts[16], counts
    assert counts[128] < 128, counts  # the loop alone was 2 x 127 (a slice and an add per token)
