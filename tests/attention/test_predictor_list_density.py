"""predictor_list_density: the kept fraction the layer predictor's own lists need for the recall target,
against the profiler's recall curve, the estimator's lists, and the oracle it can never beat."""

import pytest
import torch

from megatron_dsv.attention.analysis import _group_shapes, list_shapes, oracle_list_density, predictor_list_density
from megatron_dsv.attention.profiler import recall_curve, smallest_k_reaching
from megatron_dsv.ops.topk_estimation import critical_mass_recall, estimate_topk_naive

from .conftest import dsv_config, tf_config

S, D = 300, 16  # hidden 32 / 2 heads: D = 16 = the predictor's rank, so Wq = Wk = I is possible
SHAPES = (("query", 1, 0), ("g16_tokens", 16, 0), ("g16_blocks64", 16, 64))


def _clustered(B=1, H=2, Hkv=2, seed=0):
    """q, k [B, H(kv), S, D]: keys in contiguous runs of one cluster (so some key blocks matter and
    others not), each 16-query group near one cluster (its queries attend alike)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(6, D, generator=g) * 1.5
    k = centers[(torch.arange(S) // 40) % 6] + 0.5 * torch.randn(B, Hkv, S, D, generator=g)
    qc = torch.randint(0, 6, (B, H, -(-S // 16)), generator=g).repeat_interleave(16, -1)[..., :S]
    return centers[qc] + 0.5 * torch.randn(B, H, S, D, generator=g), k


def _layer(make_layer, kv_heads=None, **kw):
    return make_layer(dsv_config(**kw), tf_config(hidden=32, heads=2, kv_heads=kv_heads))


@pytest.mark.parametrize("proxy,block_score,kv_heads", [("mean", "max", None), ("middle", "lse", 1)],
                         ids=["mean-max-MHA", "middle-lse-GQA"])
def test_equals_recall_curve_and_the_estimators_lists(make_layer, proxy, block_score, kv_heads):
    """Read off recall_curve on the same queries (whole groups), and, independently, the estimator's
    lists of that length reach the target while one item fewer misses it."""
    layer = _layer(make_layer, kv_heads, group_proxy=proxy, block_score=block_score)
    q, k = _clustered(B=2, Hkv=kv_heads or 2, seed=1)
    target, groups = 0.9, torch.tensor([0, 7, 18])  # group 18 is the partial last one (12 queries)
    got = predictor_list_density(layer, q, k, shapes=SHAPES, target=target, group_index=groups)
    small = predictor_list_density(layer, q, k, shapes=SHAPES, target=target, group_index=groups, chunk_elems=1)
    qidx = torch.cat([torch.arange(g * 16, min(S, g * 16 + 16)) for g in groups.tolist()])
    q_lr, k_lr = layer.predictor.project(q, k, None)
    for name, G, bs in SHAPES:
        curve = recall_curve(q, k, q_lr, k_lr, G, bs, 0.9, layer.softmax_scale, qidx, proxy, block_score)
        items = smallest_k_reaching(curve, target)
        torch.testing.assert_close(got[name], (items * (bs or 1)).clamp(max=S).double() / S, rtol=0, atol=0)
        torch.testing.assert_close(small[name], got[name], rtol=0, atol=0)
        assert got[name].dtype == torch.float64 and got[name].shape == (2, 2)

        def recall(n):
            idx, counts = estimate_topk_naive(q_lr, k_lr, n, G, bs, proxy, block_score)
            return critical_mass_recall(q, k, idx, counts, G, bs, 0.9, layer.softmax_scale, qidx)

        assert (recall(items) >= target - 1e-6).all(), name
        assert ((recall(items - 1) < target + 1e-6) | (items == 1)).all(), name


def test_default_shapes_and_queries_are_the_oracles(make_layer):
    """Default: the layer's group as tokens and as kv_block_size blocks (token granularity too), the
    layer's recall target, and the oracle's evenly spread whole groups."""
    layer = _layer(make_layer, granularity="token", kv_block_size=64, recall_target=0.8)
    q, k = _clustered()
    got = predictor_list_density(layer, q, k, max_groups=5)
    assert list(got) == ["g16_tokens", "g16_blocks64"] == [n for n, _, _ in _group_shapes(layer.dsv_config)]
    assert [n for n, _, _ in list_shapes(layer.dsv_config)] == ["query", "g16_tokens"]  # token granularity
    spread = torch.linspace(0, 18, 5).round().long()
    want = predictor_list_density(layer, q, k, None, SHAPES[1:], 0.8, spread)
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_exact_scores_predictor_is_the_oracle_per_query_and_close_for_groups(make_layer):
    """Wq = Wk = I: q_lr k_lr^T = q k^T, so one query ranks its keys exactly as the oracle (equal kept
    fraction); a group ranks by its mean query, never better than the oracle and here close to it. A
    random-projection predictor is never better either."""
    layer = _layer(make_layer)
    q, k = _clustered(seed=2)
    oracle = oracle_list_density(q, k, SHAPES, 0.9, 0.96, layer.softmax_scale, max_groups=6)
    fresh = predictor_list_density(layer, q, k, shapes=SHAPES, max_groups=6)  # the JL-sketch initialisation
    with torch.no_grad():
        layer.predictor.wq.copy_(torch.eye(D).expand(2, D, D))
        layer.predictor.wk.copy_(torch.eye(D).expand(2, D, D))
    exact = predictor_list_density(layer, q, k, shapes=SHAPES, max_groups=6)
    torch.testing.assert_close(exact["query"], oracle["query"], rtol=0, atol=0)
    for name, _, _ in SHAPES:
        assert (exact[name] >= oracle[name] - 1e-12).all() and (fresh[name] >= oracle[name] - 1e-12).all(), name
        assert (exact[name] <= oracle[name] + 0.05).all(), (name, exact[name], oracle[name])
    assert (oracle["g16_blocks64"] < 1).all() and (fresh["query"] > oracle["query"]).any()  # not vacuous


@pytest.mark.parametrize("block_score,kv_heads", [("max", None), ("lse", 1)], ids=["max-MHA", "lse-GQA"])
def test_full_rank_ranks_by_the_exact_logits(make_layer, block_score, kv_heads):
    """full_rank adds exact_<name>: the same rule on the scaled exact logits. A predictor with Wq = Wk = I
    and the softmax's scale folded in ranks exactly so (equal values); a fresh one ranks independently
    of them; neither beats the oracle."""
    layer = _layer(make_layer, kv_heads, block_score=block_score)
    q, k = _clustered(Hkv=kv_heads or 2, seed=3)
    oracle = oracle_list_density(q, k, SHAPES, 0.9, 0.96, layer.softmax_scale, max_groups=6)
    fresh = predictor_list_density(layer, q, k, shapes=SHAPES, max_groups=6, full_rank=True)
    assert list(fresh) == [n for n, _, _ in SHAPES] + [f"exact_{n}" for n, _, _ in SHAPES]
    with torch.no_grad():  # q_lr k_lr^T = scale * q k^T, the exact logits
        layer.predictor.wq.copy_(torch.eye(D).expand(2, D, D) * layer.softmax_scale)
        layer.predictor.wk.copy_(torch.eye(D).expand(2, D, D))
    ident = predictor_list_density(layer, q, k, shapes=SHAPES, max_groups=6, full_rank=True)
    for name, _, _ in SHAPES:
        torch.testing.assert_close(ident[name], ident[f"exact_{name}"], rtol=0, atol=0)
        torch.testing.assert_close(fresh[f"exact_{name}"], ident[f"exact_{name}"], rtol=0, atol=0)
        assert (fresh[f"exact_{name}"] >= oracle[name] - 1e-12).all(), name
    torch.testing.assert_close(fresh["exact_query"], oracle["query"], rtol=0, atol=0)  # one query: the oracle's
    assert any((fresh[n] != fresh[f"exact_{n}"]).any() for n, _, _ in SHAPES)  # the low rank changed something


def test_full_rank_maps_query_heads_to_kv_heads_as_the_predictor(make_layer):
    """4 query heads on 2 KV heads (where interleaved and tiled maps differ): the exact ranking reads KV
    head h // 2 for query head h, as the predictor's projections do (Wq = Wk = I: equal values)."""
    layer = make_layer(dsv_config(), tf_config(hidden=64, heads=4, kv_heads=2))
    q, k = _clustered(H=4, Hkv=2, seed=4)
    k = k + torch.tensor([0.0, 3.0]).view(1, 2, 1, 1)  # the two KV heads differ
    with torch.no_grad():
        layer.predictor.wq.copy_(torch.eye(D).expand(4, D, D) * layer.softmax_scale)
        layer.predictor.wk.copy_(torch.eye(D).expand(4, D, D))
    got = predictor_list_density(layer, q, k, shapes=SHAPES, max_groups=6, full_rank=True)
    swapped = predictor_list_density(layer, q, k.flip(1), shapes=SHAPES, max_groups=6, full_rank=True)
    for name, _, _ in SHAPES:
        torch.testing.assert_close(got[name], got[f"exact_{name}"], rtol=0, atol=0)
    assert any((got[n] != swapped[n]).any() for n, _, _ in SHAPES)  # the KV heads matter here


def test_rejects_bad_arguments(make_layer):
    layer = _layer(make_layer)
    q, k = _clustered()
    for kwargs, match in [(dict(target=1.5), "`target`"), (dict(target=0.0), "`target`"),
                          (dict(shapes=(("a", 3, 0), ("b", 4, 0))), "chain of divisors"),
                          (dict(shapes=()), "`shapes` is empty"),
                          (dict(shapes=(("g16_blocks32", 16, 32),)), "block_size in \\(0, 64, 128\\)"),
                          (dict(group_index=torch.tensor([19])), "`group_index`"),
                          (dict(max_groups=0), "`max_groups`"), (dict(chunk_elems=0), "`chunk_elems`"),
                          (dict(theta=0.0), "`theta`")]:
        with pytest.raises(ValueError, match=match):
            predictor_list_density(layer, q, k, **kwargs)
    with pytest.raises(ValueError, match="`layer` must be a DSVCoreAttention"):
        predictor_list_density(torch.nn.Linear(2, 2), q, k)
    with pytest.raises(ValueError, match="`q` must have the layer's 2 heads of 16 channels"):
        predictor_list_density(layer, q[:, :1], k[:, :1])
    with pytest.raises(ValueError, match="`q` must have the layer's 2 heads of 16 channels"):
        predictor_list_density(layer, q[..., :8], k[..., :8])
    with pytest.raises(ValueError, match="`k`"):
        predictor_list_density(layer, q, k[:, :, :10])
    hidden_layer = _layer(make_layer, predictor_input="hidden")
    with pytest.raises(ValueError, match="`hidden` must be the layer's"):
        predictor_list_density(hidden_layer, q, k)
    x = torch.randn(S, 1, 32)
    got = predictor_list_density(hidden_layer, q, k, x, max_groups=2)
    assert all(((v > 0) & (v <= 1)).all() for v in got.values())
