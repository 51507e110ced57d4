"""Sparsity analysis: each measurement against its brute-force definition, the capture's
no-side-effect contract, and tools/analyze_sparsity.py end to end on a tiny live model."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_dsv.attention import dsv_layers
from megatron_dsv.attention.analysis import (capture_qk, critical_distance_histogram, cube_overlap,
                                             gaussian_sparsity, key_fractions, logit_spread, mass_curve,
                                             oracle_list_density, predictor_recall, sample_queries)
from megatron_dsv.attention.grouping import cube_order_coords
from megatron_dsv.config import DSVConfig
from megatron_dsv.ops.topk_estimation.oracle import head_sparsity

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "analyze_sparsity.py")


def _qk(B=2, H=2, Hkv=2, S=37, D=16, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, S, D, generator=g) * scale, torch.randn(B, Hkv, S, D, generator=g) * scale)


def _probs(q, k):
    """float64 [B, H, S, S] softmax rows (GQA keys repeated)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)


def _critical_set(row, theta):
    """The smallest set of keys whose mass reaches theta, by definition (highest first)."""
    order = sorted(range(len(row)), key=lambda j: -row[j])
    out, mass = set(), 0.0
    for j in order:
        if mass >= theta:
            break
        out.add(j)
        mass += row[j]
    return out


def _one_key_case(B=1, H=2, S=24, D=8, key=5):
    """Every query puts (almost) all its mass on key ``key``."""
    q = torch.ones(B, H, S, D) * 3.0
    k = torch.zeros(B, H, S, D)
    k[:, :, key] = 3.0
    return q, k


# ---------------------------------------------------------------- mass curve
@pytest.mark.parametrize("Hkv", [2, 1], ids=["MHA", "GQA"])
def test_mass_curve_matches_brute_force(Hkv):
    q, k = _qk(Hkv=Hkv)
    S = q.shape[2]
    qi = torch.tensor([0, 3, 17, 36])
    fr = key_fractions(S, 20, "linear")
    got = mass_curve(q, k, qi, fractions=fr, chunk_elems=64)  # several chunks
    p = _probs(q, k)[:, :, qi]
    cum = torch.sort(p, dim=-1, descending=True).values.cumsum(-1)
    n = [max(1, min(S, math.ceil(f * S - 1e-9))) for f in fr.tolist()]
    want = cum[..., [i - 1 for i in n]].mean(2)
    assert got.shape == (2, 2, 20)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got.diff(dim=-1) >= -1e-12).all() and torch.allclose(got[..., -1], torch.ones(2, 2, dtype=torch.float64))


def test_mass_curve_uniform_attention_is_linear():
    S = 40
    q, k = torch.zeros(1, 1, S, 8), torch.randn(1, 1, S, 8)
    fr = torch.arange(1, S + 1, dtype=torch.float64) / S
    torch.testing.assert_close(mass_curve(q, k, fractions=fr)[0, 0], fr, atol=1e-6, rtol=0)


def test_key_fractions_and_query_sampling():
    for spacing in ("log", "linear"):
        fr = key_fractions(1000, 100, spacing)
        assert fr.shape == (100,) and abs(float(fr[0]) - 1e-3) < 1e-12 and float(fr[-1]) == 1.0
        assert (fr.diff() > 0).all()
    assert sample_queries(32, 8).tolist() == [4, 12, 20, 28]
    qi = sample_queries(10_000, 1, max_queries=100)
    assert qi.numel() == 100 and int(qi[0]) == 0 and int(qi[-1]) == 9_999 and (qi.diff() > 0).all()
    with pytest.raises(ValueError, match="spacing"):
        key_fractions(10, 5, "cubic")


# ---------------------------------------------------------------- a known answer
def test_one_key_holding_all_mass():
    S, key = 24, 5
    q, k = _one_key_case(S=S, key=key)
    assert torch.allclose(head_sparsity(q, k, 0.9), torch.full((1, 2), (S - 1) / S))
    curve = mass_curve(q, k, fractions=torch.tensor([1.0 / S, 0.5, 1.0]))
    assert torch.allclose(curve, torch.ones_like(curve), atol=1e-6)
    coords = cube_order_coords((2, 3, 4), (1, 1, 2))
    hist = critical_distance_histogram(q, k, coords, theta=0.9, bins=torch.tensor([0.0, 0.5, 10.0]), radius=1.0)
    dist = (coords.double() - coords[key].double()).norm(dim=-1)
    assert hist["critical"][0, 0].tolist() == [1.0, S - 1.0]  # only the key itself is at distance 0
    assert torch.allclose(hist["within_radius"], torch.full((1, 2), float((dist <= 1.0).sum()) / S,
                                                            dtype=torch.float64))
    over = cube_overlap(q, k, group_size=4, theta=0.9)
    assert torch.allclose(over["jaccard"], torch.ones(1, 2, dtype=torch.float64))
    assert torch.allclose(over["containment"], torch.ones(1, 2, dtype=torch.float64))


# ---------------------------------------------------------------- distances
@pytest.mark.parametrize("theta", [0.5, 0.9])
def test_distance_histogram_matches_brute_force(theta):
    grid, cube = (3, 4, 5), (1, 2, 2)
    coords = cube_order_coords(grid, cube)
    q, k = _qk(B=1, H=2, Hkv=1, S=60, D=16, seed=1)
    qi = torch.tensor([0, 7, 31, 59])
    got = critical_distance_histogram(q, k, coords, qi, theta, bins=7, radius=2.0, chunk_elems=200)
    edges = got["edges"].numpy()
    assert edges[0] == 0 and abs(edges[-1] - math.dist((0, 0, 0), (2, 3, 4))) < 1e-12
    p = _probs(q, k)
    for h in range(2):
        dists = []
        for i in qi.tolist():
            crit = _critical_set(p[0, h, i].tolist(), theta)
            dists += [math.dist(coords[i].tolist(), coords[j].tolist()) for j in crit]
        want, _ = np.histogram(dists, bins=edges)
        assert got["critical"][0, h].tolist() == want.tolist()
        assert abs(float(got["within_radius"][0, h]) - np.mean(np.asarray(dists) <= 2.0)) < 1e-12
    every = [math.dist(coords[i].tolist(), coords[j].tolist()) for i in qi.tolist() for j in range(60)]
    assert got["all_keys"].tolist() == np.histogram(every, bins=edges)[0].tolist()


def test_distance_histogram_rejects_bad_coords():
    q, k = _qk(S=12)
    with pytest.raises(ValueError, match="coords"):
        critical_distance_histogram(q, k, torch.zeros(11, 3))


# ---------------------------------------------------------------- cube overlap
# ---------------------------------------------------------------- logit spread and its Gaussian sparsity
@pytest.mark.parametrize("Hkv", [2, 1], ids=["MHA", "GQA"])
def test_logit_spread_matches_brute_force(Hkv):
    q, k = _qk(Hkv=Hkv, S=41)
    qi = torch.tensor([0, 3, 17, 40])
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).double()
    logits = q.double()[:, :, qi] @ kk.transpose(-1, -2) * 0.3
    want = logits.std(-1, correction=0).mean(-1)
    got = logit_spread(q, k, qi, softmax_scale=0.3, chunk_elems=2 * 2 * 41)  # one query per chunk
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gaussian_sparsity_closed_form_and_sampled_logits():
    assert gaussian_sparsity(1.0) == pytest.approx(0.3891, abs=1e-3)  # QK-norm at init: logit std 1
    assert gaussian_sparsity(2.3217) == pytest.approx(0.85, abs=1e-3)
    assert gaussian_sparsity(0.0) == pytest.approx(0.1, abs=1e-9)  # uniform: 90% of the keys for 90% of mass
    sig = torch.tensor([0.5, 1.0, 2.0])
    assert torch.all(gaussian_sparsity(sig).diff() > 0)
    # logits q . k / sqrt(D) with q, k i.i.d. N(0, s^2) are close to N(0, s^4): the oracle agrees with the formula
    S, D = 20000, 64
    for s in (1.0, 1.3):
        g = torch.Generator().manual_seed(1)
        q = torch.randn(1, 1, S, D, generator=g) * s
        k = torch.randn(1, 1, S, D, generator=g) * s
        qi = torch.arange(0, S, S // 64)
        sigma = logit_spread(q, k, qi)
        assert float(sigma) == pytest.approx(s * s, rel=0.05)
        exact = float(head_sparsity(q, k, 0.9, query_index=qi))
        assert exact == pytest.approx(gaussian_sparsity(float(sigma)), abs=0.03)
    with pytest.raises(ValueError, match="theta"):
        gaussian_sparsity(1.0, theta=1.0)


def test_cube_overlap_matches_brute_force():
    S, G, theta = 30, 4, 0.8  # the last group has 2 queries
    q, k = _qk(B=1, H=2, Hkv=2, S=S, D=8, seed=2, scale=1.5)
    p = _probs(q, k)
    groups = [0, 3, 7]
    got = cube_overlap(q, k, G, theta, group_index=torch.tensor(groups))
    small_chunks = cube_overlap(q, k, G, theta, group_index=torch.tensor(groups), chunk_elems=1)
    for h in range(2):
        jac, con = [], []
        for g in groups:
            sets = [_critical_set(p[0, h, i].tolist(), theta) for i in range(g * G, min(S, (g + 1) * G))]
            for a in range(len(sets)):
                for b in range(len(sets)):
                    if a != b:
                        jac.append(len(sets[a] & sets[b]) / len(sets[a] | sets[b]))
                        con.append(len(sets[a] & sets[b]) / len(sets[a]))
        assert abs(float(got["jaccard"][0, h]) - np.mean(jac)) < 1e-12
        assert abs(float(got["containment"][0, h]) - np.mean(con)) < 1e-12
    torch.testing.assert_close(got["jaccard"], small_chunks["jaccard"])
    assert got["groups"] == 3
    assert cube_overlap(q, k, 1, theta)["jaccard"].isnan().all()  # no pairs in one-token groups


# ---------------------------------------------------------------- oracle list density
def _best_mean_recall(p_rows, sets, items, n):
    """Exhaustive: the highest mean recall (critical mass inside / critical mass) of the group's
    queries over every list of n items (an item = a set of key ids)."""
    import itertools

    best = 0.0
    for pick in itertools.combinations(range(len(items)), n):
        keys = set().union(*(items[i] for i in pick))
        rec = [sum(row[j] for j in crit & keys) / sum(row[j] for j in crit) for row, crit in zip(p_rows, sets)]
        best = max(best, float(np.mean(rec)))
    return best


def test_oracle_list_density_matches_exhaustive_search():
    """Against every list of every length: the smallest length whose best lists reach the target mean
    recall (one length per head, the mean over all measured queries), token and block lists, a partial
    last block and a partial last group."""
    S, theta, target = 10, 0.8, 0.9
    q, k = _qk(B=1, H=2, Hkv=1, S=S, D=8, seed=5, scale=1.2)
    p = _probs(q, k)
    shapes = (("query", 1, 0), ("pairs", 2, 0), ("g4", 4, 0), ("g4_blocks3", 4, 3))
    got = oracle_list_density(q, k, shapes, theta, target, max_groups=10)  # every group: 0-3 (3 partial)
    chunked = oracle_list_density(q, k, shapes, theta, target, max_groups=10, chunk_elems=1)  # one query a pass
    pairs = oracle_list_density(q, k, shapes, theta, target, max_groups=10, chunk_elems=40)  # 2 queries a pass
    for name, G, bs in shapes:
        items = [set(range(j, min(S, j + bs))) for j in range(0, S, bs)] if bs else [{j} for j in range(S)]
        for h in range(2):
            groups = [list(range(g0, min(S, g0 + G))) for g0 in range(0, S, G)]
            sets = {i: _critical_set(p[0, h, i].tolist(), theta) for i in range(S)}
            want = None
            for n in range(1, len(items) + 1):
                total = sum(_best_mean_recall([p[0, h, i].tolist() for i in grp], [sets[i] for i in grp], items, n)
                            * len(grp) for grp in groups)
                if total / S >= target - 1e-12:
                    want = min(S, n * (bs or 1)) / S
                    break
            assert abs(float(got[name][0, h]) - want) < 1e-12, (name, h)
        torch.testing.assert_close(got[name], chunked[name])
        torch.testing.assert_close(got[name], pairs[name])


def test_oracle_list_density_orders_the_costs():
    """Sharing a list among more queries and keeping blocks whole can only cost keys; queries that
    attend alike share for free."""
    q, k = _qk(B=1, H=3, Hkv=3, S=300, D=16, seed=7, scale=1.5)
    got = oracle_list_density(q, k, max_groups=3)
    order = ["query", "g32_tokens", "g128_tokens", "g128_blocks128"]
    for a, b in zip(order, order[1:]):
        assert (got[a] <= got[b] + 1e-12).all(), (a, b)
    assert (got["g128_blocks128"] > got["query"]).all()
    same = q[:, :, :1].expand_as(q).contiguous()  # every query the same: one list serves all
    alike = oracle_list_density(same, k, (("query", 1, 0), ("g128_tokens", 128, 0)), max_groups=2)
    torch.testing.assert_close(alike["query"], alike["g128_tokens"])


def test_oracle_list_density_rejects_bad_arguments():
    q, k = _qk(B=1, H=1, Hkv=1, S=40, D=8)
    with pytest.raises(ValueError, match="chain of divisors"):
        oracle_list_density(q, k, (("a", 3, 0), ("b", 4, 0)))
    with pytest.raises(ValueError, match="target"):
        oracle_list_density(q, k, target=1.5)
    with pytest.raises(ValueError, match="group_index"):
        oracle_list_density(q, k, group_index=torch.tensor([5]))


# ---------------------------------------------------------------- capture and the predictor
SMALL_MODEL = dict(latent_frames=2, latent_height=8, latent_width=8, layers=2)


def _tiny_model():
    from megatron_dsv.models.video_dit import VideoDiTConfig, build_video_dit

    torch.manual_seed(0)
    cfg = VideoDiTConfig.from_preset("tiny", **SMALL_MODEL)
    dsv = DSVConfig(query_group_shape=(1, 4, 4), granularity="token", k_min=8, topk_backend="naive",
                    kernel_backend="naive", max_density=None)  # a budget density of 1 keeps every key
    model = build_video_dit(cfg, dsv_config=dsv, use_te=False)
    with torch.no_grad():  # leave adaLN-Zero: layers must see different inputs
        for name, prm in model.named_parameters():
            if "predictor" not in name:
                prm.add_(torch.randn_like(prm) * 0.05)
    x = torch.randn(2, cfg.in_channels, *cfg.latent_grid)
    return model, x, torch.tensor([0.3, 0.7]), torch.tensor([0, 3])


def test_capture_qk_leaves_dsv_state_unchanged(megatron_cpu):
    model, x, t, y = _tiny_model()
    layers = dsv_layers(model)
    for i, layer in enumerate(layers):  # a stage-2 sparse-ready state, as after training
        layer.stage.fill_(2)
        layer.sparsity.fill_(0.7 + 0.1 * i)
        layer.budget_density.fill_(0.3)
        layer.recall.fill_(0.9)
        layer.profiles.fill_(3)
        layer._sync_host()
        layer.last_k.fill_(7.0)
    model.train()
    before = {n: b.clone() for n, b in model.named_buffers()}
    hosts = [(layer.last_k.clone(), layer.last_sparse, layer.force_dense, layer.stage_host) for layer in layers]
    out = capture_qk(model, x, t, y)
    assert sorted(out) == [1, 2]
    for q, k in out.values():
        assert q.shape == (2, 2, 32, 64) and k.shape == (2, 2, 32, 64)
    assert not torch.equal(out[1][0], out[2][0])
    for n, b in model.named_buffers():
        torch.testing.assert_close(b, before[n], rtol=0, atol=0, equal_nan=True, msg=n)
    assert model.training
    for layer, (last_k, sparse, dense, stage) in zip(layers, hosts):
        assert torch.equal(layer.last_k, last_k) and layer.last_sparse == sparse
        assert layer.force_dense == dense and layer.stage_host == stage
        assert not layer._forward_pre_hooks  # the hook is gone


def test_predictor_recall_is_one_when_lists_hold_every_key(megatron_cpu):
    model, x, t, y = _tiny_model()
    layer = dsv_layers(model)[0]
    q, k = capture_qk(model, x, t, y)[1]
    fresh = predictor_recall(layer, q, k, theta=0.9)
    assert fresh["budget_source"] == "measured_sparsity"
    torch.testing.assert_close(fresh["sparsity"], head_sparsity(q, k, 0.9, layer.softmax_scale))
    assert ((fresh["recall"] > 0) & (fresh["recall"] <= 1 + 1e-6)).all()
    layer.budget_density.fill_(1.0)
    layer.profiles.fill_(1)
    layer._sync_host()
    full = predictor_recall(layer, q, k, theta=0.9)
    assert full["budget_source"] == "layer_state" and full["tokens"].tolist() == [32, 32]
    torch.testing.assert_close(full["recall"], torch.ones(2, 2))


# ---------------------------------------------------------------- the tool
def _trajectory(path):
    rows = [dict(bench="recall_trajectory", arm=arm, step=s, layer=n, sparsity_measured=0.3 + 0.01 * s,
                 sparsity=0.3 + 0.01 * s + 0.02 * n, budget_density=0.5, recall=0.9, sparse=0.0, predictor_loss=0.1)
            for arm in ("a", "b") for s in (1, 10, 20) for n in (1, 2)]
    rows.append(dict(bench="recall", layer=1, recall=0.9))  # a summary row: skipped
    path.write_text(json.dumps({"meta": {"gpu": "test"}, "rows": rows}))
    return str(path)


def test_tool_end_to_end(megatron_cpu, tmp_path):
    from tools.analyze_sparsity import main

    out = tmp_path / "out"
    rc = main(["--preset", "tiny", "--device", "cpu", "--grid", "2", "8", "8", "--samples", "2",
               "--model-override", "layers=2", "--dsv-query-group-shape", "1", "4", "4", "--dsv-granularity", "token",
               "--query-stride", "2", "--bins", "8", "--trajectory", _trajectory(tmp_path / "traj.json"),
               "--out-dir", str(out)])
    assert rc == 0
    data = json.loads((out / "analysis.json").read_text())
    for key in ("theta", "S", "grid", "cube", "key_fractions", "distance_edges", "layers", "summary", "meta",
                "trajectory"):
        assert key in data, key
    assert data["S"] == 32 and data["grid"] == [2, 4, 4] and len(data["distance_edges"]) == 9
    assert [r["layer"] for r in data["layers"]] == [1, 2]
    for rep in data["layers"]:
        assert len(rep["sparsity"]) == 2 and all(0 <= s < 1 for s in rep["sparsity"])
        assert len(rep["mass_curve"]) == 2 and len(rep["mass_curve"][0]) == len(data["key_fractions"])
        assert abs(sum(rep["distance_critical"]) - 1) < 1e-4 and len(rep["distance_critical"]) == 8
        for key in ("jaccard", "containment", "group_size"):
            assert key in rep["cube_overlap"]
        for key in ("recall", "budget_density", "budget_source", "sparse", "state_sparsity"):
            assert key in rep["predictor"]
        # group of 16 (1x4x4) as tokens: no 32-query shape; token granularity: no block shape
        assert set(rep["list_density"]) == {"target", "query", "g16_tokens"}
        assert all(a <= b + 1e-9 for a, b in zip(rep["list_density"]["query"], rep["list_density"]["g16_tokens"]))
        # the predictor's own lists: the group as tokens and as kv_block_size blocks, never below the oracle
        pred = rep["predictor_list_density"]
        # (and exact_*: the same ranking rule on the exact logits), never below the oracle
        ranked = {"g16_tokens", "g16_blocks128", "exact_g16_tokens", "exact_g16_blocks128"}
        assert set(pred) == {"target"} | ranked and pred["target"] == 0.96
        assert all(0 < v <= 1 for name in ranked for v in pred[name])
        for name in ("g16_tokens", "exact_g16_tokens"):
            assert all(p >= o - 1e-9 for p, o in zip(pred[name], rep["list_density"]["g16_tokens"]))
    assert set(data["summary"]["predictor_list_density"]) == ranked
    assert set(data["trajectory"]["runs"]) == {"arm=a", "arm=b"}
    assert data["trajectory"]["runs"]["arm=a"]["median_last"] == pytest.approx(0.3 + 0.2 + 0.04)
    for name in ("sparsity_heatmap", "mass_curves", "distance_histogram", "cube_overlap", "list_costs",
                 "predictor_recall", "sparsity_trajectory"):
        assert (out / f"{name}.png").stat().st_size > 1000, name


def test_tool_reads_latent_shards(megatron_cpu, tmp_path):
    from megatron_dsv.data.shards import write_shard
    from tools.analyze_sparsity import main

    shards = tmp_path / "shards"
    shards.mkdir()
    write_shard(str(shards / "a.safetensors"), torch.randn(3, 4, 2, 8, 8), torch.tensor([0, 1, 2]))
    out = tmp_path / "out"
    assert main(["--preset", "tiny", "--device", "cpu", "--data", str(shards), "--samples", "1", "--model-override",
                 "layers=1", "--dsv-query-group-shape", "1", "4", "4", "--out-dir", str(out)]) == 0
    data = json.loads((out / "analysis.json").read_text())
    assert data["batch"] == 1 and data["meta"]["data"] == str(shards) and not (out / "sparsity_trajectory.png").exists()


def test_tool_help_and_bad_arguments(tmp_path):
    res = subprocess.run([sys.executable, TOOL, "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    for flag in ("--load", "--preset", "--data", "--samples", "--timestep", "--theta", "--trajectory", "--out-dir"):
        assert flag in res.stdout
    from tools.analyze_sparsity import load_trajectory, main

    with pytest.raises(SystemExit) as err:
        main(["--preset", "tiny", "--timestep", "1.5"])
    assert err.value.code == 2
    with pytest.raises(SystemExit) as err:
        main(["--out-dir", str(tmp_path)])  # neither --load nor --preset
    assert err.value.code == 2
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"meta": {}, "rows": [{"bench": "recall", "layer": 1}]}))
    with pytest.raises(SystemExit, match="no rows with 'step', 'layer' and 'sparsity'"):
        load_trajectory(str(empty))


def test_tool_on_a_converted_wan_before_training(megatron_cpu, tmp_path):
    """--pretrained: a tiny diffusers Wan2.1, converted, analysed as it is (per layer and head) with synthetic text."""
    diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed: pip install -e .[wan]")
    pytest.importorskip("safetensors", reason="safetensors is not installed: pip install -e .[wan]")
    from megatron_dsv.models.wan_convert import convert_diffusers_folder
    from tools.analyze_sparsity import main, synthetic_text

    torch.manual_seed(0)
    theirs = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32,
                                             in_channels=4, out_channels=4, text_dim=24, freq_dim=32, ffn_dim=64,
                                             num_layers=2, rope_max_seq_len=32)
    theirs.save_pretrained(str(tmp_path / "diffusers"), safe_serialization=True)
    convert_diffusers_folder(str(tmp_path / "diffusers"), str(tmp_path / "wan"), latent_grid=(2, 8, 8))
    out = tmp_path / "out"
    rc = main(["--pretrained", str(tmp_path / "wan"), "--device", "cpu", "--grid", "2", "8", "8", "--samples", "1",
               "--dsv-query-group-shape", "1", "4", "4", "--dsv-granularity", "token", "--query-stride", "2",
               "--bins", "8", "--text-len", "6", "--text-tokens", "4", "--out-dir", str(out)])
    assert rc == 0
    data = json.loads((out / "analysis.json").read_text())
    assert data["S"] == 32 and data["grid"] == [2, 4, 4] and data["cube"] == [1, 4, 4]
    assert [r["layer"] for r in data["layers"]] == [1, 2] and data["meta"]["source"].startswith("converted Wan")
    assert data["meta"]["text"].startswith("synthetic: 4 random-normal")
    for rep in data["layers"]:
        assert len(rep["sparsity"]) == 2 and all(0 <= s < 1 for s in rep["sparsity"])
    assert (out / "sparsity_heatmap.png").stat().st_size > 1000
    text = synthetic_text(1, 6, 4, 24, seed=0)
    assert text[:, 4:].abs().sum() == 0 and text[:, :4].abs().min() > 0  # Wan's zero padding after the tokens
    with pytest.raises(SystemExit) as err:  # a diffusers folder is not a converted checkpoint
        main(["--pretrained", str(tmp_path / "diffusers"), "--out-dir", str(out)])
    assert err.value.code == 2
