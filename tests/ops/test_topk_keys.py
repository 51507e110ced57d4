"""Triton top-k, methods "keys" (one scoring pass writing every item's key, then one packed int64
torch.topk per chunk of groups) and "gemm" (the same keys from one batched matrix product): the same lists
as naive, exactly on integer inputs, up to near-exact ties on continuous ones; "auto" takes "keys" on tensor cores
for fp16/bf16 block lists, "gemm" for fp32 ones.

Runs under the Triton interpreter on this CPU machine (fp32, fp16) and on CUDA when a GPU is present;
the GPU tests of ``test_topk_estimation.py`` reach it too, through "auto" on their block-list cases.
"""

import pytest
import torch

from megatron_dsv.ops.topk_estimation import estimate_topk_naive, tensor_core_scorable
from megatron_dsv.ops.topk_estimation.keys_impl import _select_from_keys
from megatron_dsv.ops.topk_estimation.triton_impl import estimate_topk_triton, resolve_method, resolve_tile
from tests.ops.test_topk_estimation import _near_tie_equal

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ints(shape, dtype, seed, lo=-3, hi=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).to(dtype).to(DEV)


CASES = [  # B, H, Sq, Sk, r, G, block_size, proxy, block_score, budgets
    pytest.param(1, 3, 300, 300, 32, 16, 64, "mean", "max", [1, 2, 5], id="blk64-S300-max"),
    pytest.param(1, 2, 301, 301, 16, 32, 128, "middle", "lse", [1, 3], id="blk128-S301-lse"),
    pytest.param(2, 2, 70, 2000, 16, 32, 128, "mean", "max", [[0, 15], [16, 40]], id="blk128-Sk2000-clip-zero"),
    # fp32 "mean" proxies of a partial group round differently under fma (every Triton method alike; see
    # test_topk_sample.py): whole groups of 32 queries, an odd key length
    pytest.param(1, 2, 224, 203, 16, 32, 0, "mean", "max", [5, 40], id="tok-Sk203"),
    pytest.param(2, 2, 130, 130, 8, 7, 0, "middle", "max", [[1, 130], [200, 3]], id="tok-G7-all-clip"),
]


@pytest.mark.parametrize("B,H,Sq,Sk,r,G,bs,proxy,bscore,budgets", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("chunk", [1 << 25, 7], ids=["one-chunk", "group-per-chunk"])
@pytest.mark.parametrize("method", ["keys", "gemm"])
def test_keys_equals_naive_integer_ties(B, H, Sq, Sk, r, G, bs, proxy, bscore, budgets, dtype, chunk, method):
    """Small-integer inputs: every score exact (in any order of summation), heavy ties at every threshold;
    chunking over groups (down to one group per chunk) changes nothing."""
    q, k = _ints((B, H, Sq, r), dtype, 41), _ints((B, H, Sk, r), dtype, 42)
    budgets = torch.tensor(budgets)
    ref = estimate_topk_naive(q, k, budgets, G, bs, proxy, bscore)
    got = estimate_topk_triton(q, k, budgets, G, bs, proxy, bscore, method=method, chunk_elems=chunk)
    assert torch.equal(ref[1], got[1]) and got[0].dtype == torch.int32
    assert torch.equal(ref[0], got[0])


@pytest.mark.parametrize("B,H,Sq,Sk,r,G,bs,proxy,bscore,budgets", [c for c in CASES if c.values[6] > 0])
@pytest.mark.parametrize("method,dtype,dot", [("keys", torch.float16, "tc"), ("keys", torch.float32, True),
                                              ("search", torch.float16, "tc"), ("sample", torch.float16, "tc")],
                         ids=["keys-fp16-tc", "keys-fp32-dot", "search-fp16-tc", "sample-fp16-tc"])
def test_block_items_scored_by_one_product_equal_naive(B, H, Sq, Sk, r, G, bs, proxy, bscore, budgets, method, dtype,
                                                       dot):
    """``dot`` on block lists: each tile's [BG, r] x [r, BN * block_size] product over its blocks' tokens, then
    the block max or log-sum-exp (:func:`scoring._scores_at`), in every kernel that scores (keys, the search, the
    sample pass and its write). Integer inputs make every sum exact in any order, so the lists equal naive's bit for
    bit: partial last blocks (Sk 300, 301, 2000), clipped and zero budgets, both block scores."""
    q, k = _ints((B, H, Sq, r), dtype, 51), _ints((B, H, Sk, r), dtype, 52)
    budgets = torch.tensor(budgets)
    ref = estimate_topk_naive(q, k, budgets, G, bs, proxy, bscore)
    st = {}
    got = estimate_topk_triton(q, k, budgets, G, bs, proxy, bscore, method=method, dot=dot, sample_size=8, stats=st)
    assert torch.equal(ref[1], got[1])
    assert torch.equal(ref[0], got[0])
    if method == "sample":  # the sample pass scores scattered items; its exact fallback would hide wrong scores there
        loop = {}
        estimate_topk_triton(q, k, budgets, G, bs, proxy, bscore, method=method, dot=False, sample_size=8, stats=loop)
        assert st["fallback_groups"] == loop["fallback_groups"]


def test_block_items_by_one_product_on_the_benchs_wider_tiles():
    """The bench's other tilings (32 and 128 groups x 2 blocks a tile) under the interpreter: integer inputs,
    naive's lists bit for bit."""
    q, k = _ints((1, 2, 300, 16), torch.float16, 56), _ints((1, 2, 1000, 16), torch.float16, 57)
    budgets = torch.tensor([2, 5])
    ref = estimate_topk_naive(q, k, budgets, 32, 128)
    for BG in (32, 128):
        got = estimate_topk_triton(q, k, budgets, 32, 128, method="keys", dot="tc", BG=BG, BN=2)
        assert torch.equal(ref[0], got[0]), BG


@pytest.mark.parametrize("dtype,dot", [(torch.float16, "tc"), (torch.float32, True), (torch.float32, False)],
                         ids=["fp16-tc", "fp32-dot", "fp32-loop"])
@pytest.mark.parametrize("bscore", ["max", "lse"])
def test_partial_last_block_padding_scores_nothing(dtype, dot, bscore):
    """Positive queries and negative keys: every real score is negative, so a padded token of the partial last
    block scored as 0 (not -inf) would lift that block to the top of every list."""
    q, k = _ints((1, 2, 64, 16), dtype, 53, 1, 4), _ints((1, 2, 300, 16), dtype, 54, -3, 0)
    budgets = torch.tensor([1, 2])
    ref = estimate_topk_naive(q, k, budgets, 32, 128, "mean", bscore)
    assert not (ref[0] == 2).any()  # the partial block (44 tokens) is no group's best here
    got = estimate_topk_triton(q, k, budgets, 32, 128, "mean", bscore, method="keys", dot=dot)
    assert torch.equal(ref[0], got[0])


@pytest.mark.parametrize("bs,BG", [(64, 2), (0, 16)], ids=["blk64-BG2", "tok-BG16"])
def test_keys_chunks_with_a_remainder(bs, BG):
    """Chunks of 3 and 5 of the 9 groups (the last chunk partial), tiles of BG rows smaller than a chunk,
    continuous fp32 inputs (a last-bit difference of the partial group's mean proxy could only swap items
    tied within an ulp: none at this seed), zero and full budgets, Sq != Sk."""
    g = torch.Generator().manual_seed(45)
    q = torch.randn(2, 2, 9 * 32 - 5, 16, generator=g).to(DEV)
    Sk = 600
    k = torch.randn(2, 2, Sk, 16, generator=g).to(DEV)
    n_items = Sk if bs == 0 else -(-Sk // bs)
    budgets = torch.tensor([[0, n_items], [3, n_items // 4]])
    ref = estimate_topk_naive(q, k, budgets, 32, bs)
    for groups in (3, 5):
        got = estimate_topk_triton(q, k, budgets, 32, bs, method="keys", BG=BG, chunk_elems=groups * 4 * n_items + 1)
        assert torch.equal(ref[1], got[1]) and torch.equal(ref[0], got[0]), groups
        # "gemm" chunks by its scores (float64 for these float32 inputs: 2 * chunk_elems of them, at least one
        # key's worth per item): 3 and 5 groups a chunk again
        per_group = 4 * max(n_items, Sk // 2)
        got = estimate_topk_triton(q, k, budgets, 32, bs, method="gemm", chunk_elems=groups * per_group + 1)
        _near_tie_equal(q, k, ref[0], got[0], ref[1], 32, bs, "mean", "max", who=f"gemm {groups}")


def test_auto_method_for_blocks_and_all_methods_agree():
    """"auto" takes "keys" on tensor cores for fp16/bf16 block lists (run 27), "gemm" for fp32 ones and for forced
    token lists, "sample" for other token lists; every method gives the same lists (integer inputs: no ties)."""
    q, k = _ints((1, 2, 64, 16), torch.float32, 43), _ints((1, 2, 900, 16), torch.float32, 44)
    methods = ("auto", "keys", "gemm", "search", "sample")
    lists = {m: estimate_topk_triton(q, k, 3, 32, 64, method=m)[0] for m in methods}
    assert all(torch.equal(lists["keys"], v) for v in lists.values())
    with pytest.raises(ValueError, match="`chunk_elems`"):
        estimate_topk_triton(q, k, 3, 32, 64, method="keys", chunk_elems=0)
    assert resolve_method("auto", 64) == "gemm" and resolve_method("auto", 0) == "sample"
    assert resolve_method("auto", 128, tensor_cores=True) == "keys"
    assert resolve_method("auto", 0, tensor_cores=True) == "sample"
    assert resolve_method("auto", 0, tensor_cores=True, forced=True) == "gemm"
    assert resolve_method("auto", 128, forced=True) == "gemm"
    assert resolve_method("search", 128, tensor_cores=True) == "search"
    with pytest.raises(ValueError, match="`method`"):
        resolve_method("radix", 0)
    assert tensor_core_scorable(torch.bfloat16, 16) and tensor_core_scorable(torch.float16, 32)
    assert not tensor_core_scorable(torch.float32, 16) and not tensor_core_scorable(torch.bfloat16, 8)
    assert not tensor_core_scorable(torch.bfloat16, 24)


def test_resolve_tile_defaults():
    """run 27's tile for "keys" on tensor cores over blocks (64 groups x 256 tokens), 16 groups elsewhere; explicit
    values pass through."""
    assert resolve_tile("keys", "tc", 128) == (64, 2) and resolve_tile("keys", "tc", 64) == (64, 4)
    assert resolve_tile("keys", False, 128) == (16, 0) and resolve_tile("gemm", "tc", 128) == (16, 0)
    assert resolve_tile("sample", "tc", 0) == (16, 0) and resolve_tile("keys", "tc", 0) == (16, 0)
    assert resolve_tile("keys", "tc", 128, BG=32) == (32, 2) and resolve_tile("keys", "tc", 128, 16, 4) == (16, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_auto_block_lists_on_the_default_tile(dtype, monkeypatch):
    """The defaults as they run: "auto" on fp16 block lists scores on tensor cores in "keys" on 64 x 256-token
    tiles, fp32 ones in "gemm"; both give naive's lists on integer inputs (exact in fp16: |x| <= 8, r = 16)
    over odd lengths, a partial last block, fewer groups than a tile, clipped budgets and forced items."""
    from megatron_dsv.ops.topk_estimation import triton_impl

    q, k = _ints((1, 2, 200, 16), dtype, 45), _ints((1, 2, 1000, 16), dtype, 46)
    budgets = torch.tensor([[3, 9]])
    ran = []
    lists_by_keys = triton_impl._lists_by_keys
    monkeypatch.setattr(triton_impl, "_lists_by_keys", lambda method, *a: ran.append((method, a[-1])) or
                        lists_by_keys(method, *a))
    ref = estimate_topk_naive(q, k, budgets, 32, 128)
    got = estimate_topk_triton(q, k, budgets, 32, 128)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    method, meta = ran[0]
    if dtype == torch.float16:  # "keys", tensor cores (DOT 2), 64 groups x 2 blocks of 128
        assert (method, meta["DOT"], meta["BG"], meta["BN"]) == ("keys", 2, 64, 2)
    else:
        assert method == "gemm"
    forced = torch.tensor([[0, 7], [1, -1], [2, 3], [4, -1], [5, 6], [7, -1], [0, -1]])
    ref = estimate_topk_naive(q, k, budgets, 32, 128, forced=forced, forced_extra=True)
    got = estimate_topk_triton(q, k, budgets, 32, 128, forced=forced, forced_extra=True)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_select_from_keys_tie_rule_and_padding():
    """The packed order is (key descending, index ascending); negative keys and the int32 extremes
    keep their order; a row keeps its head's count, ascending, then -1."""
    keys = torch.tensor([[[5, -7, 5, 2**31 - 1, -2**31, 5]],
                         [[0, 0, 0, 0, 0, 0]]], dtype=torch.int32)
    out = _select_from_keys(keys, torch.tensor([3, 2]), 3)
    assert out.tolist() == [[[0, 2, 3]], [[0, 1, -1]]]
    out = _select_from_keys(keys, torch.tensor([6, 0]), 6)
    assert out.tolist() == [[[0, 1, 2, 3, 4, 5]], [[-1] * 6]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles the tensor-core product: needs a CUDA GPU")
@pytest.mark.parametrize("BG,BN", [(16, 4), (32, 4), (64, 2), (128, 2)],
                         ids=["BG16-BN4", "BG32-BN4", "BG64-BN2", "BG128-BN2"])
def test_block_items_on_tensor_cores_give_naives_lists_up_to_near_ties_on_the_gpu(BG, BN):
    """Continuous bf16 inputs, the library's block lists (G = 128, blocks of 128 keys, a partial last block):
    method "keys" with ``dot="tc"`` (the bench's block candidates' tiles) must give naive's lists except items within
    a few ulps of a group's threshold (the CUDA kernel's rule), every list its count of ascending items."""
    torch.manual_seed(55)
    S = 16384 + 77
    q = torch.randn(1, 4, S, 16, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, S, 16, device="cuda", dtype=torch.bfloat16)
    budgets = torch.tensor([13, 4, 30, 129], device="cuda")
    ref = estimate_topk_naive(q, k, budgets, 128, 128)
    got = estimate_topk_triton(q, k, budgets, 128, 128, method="keys", dot="tc", BG=BG, BN=BN)
    assert torch.equal(ref[1], got[1])
    _near_tie_equal(q, k, ref[0], got[0], ref[1], 128, 128, "mean", "max", who=f"keys tc BG{BG}")
