"""What limits DSV's recall of the theta-critical mass: predictor, granularity, or budget rule?

Loads a trained video DiT checkpoint, runs one forward on synthetic videos (noised at a few
flow-matching times) and, inside every DSV layer (post-RoPE q, k), measures the recall of the
critical mass (the metric of ``ops.topk_estimation.oracle.critical_mass_recall``) of KV lists
built from several scorers:

* ``oracle``  the best possible list for the group: items ranked by the group's own mean
              critical-mass share (recall is additive over keys, so this is optimal for a given
              group / block / budget; it isolates granularity + budget limits);
* ``exact``   full-rank true scores, ranked like the estimator (mean query of the group,
              block score = max over the block) -- at G=1, token lists this is per-query top-K;
* ``svdR``    best rank-R approximation of the true logits q k^T (per head, per video);
* ``pred``    the layer's trained LowRankPredictor (``project``), as the estimator uses it.

for query groups G (consecutive cube-order tokens) and KV granularity (0 = tokens, 64, 128),
at budgets m * K_h for m in --mults, K_h = max(ceil((1 - s_h) S), k_min) rounded up to the block
(the dispatcher's rule; s_h = the exact token sparsity at theta measured on this batch).
Recall is computed as a curve over all budgets at once, so the table also gives ``K95``: the
budget (fraction of S, mean over heads) each variant needs for 0.95 recall.

``--cube`` re-orders q/k into another cube-major order (attention is permutation-equivariant), so one
checkpoint serves any query-group shape; ``--logit-scale`` sharpens the true softmax (a stress test
of higher sparsity on a briefly trained model; every ranking is unchanged, only the critical sets shrink).

    PYTHONPATH=. python benchmarks/diagnose_recall.py --ckpt /tmp/diag/checkpoints --cube 4 4 8
    PYTHONPATH=. python benchmarks/diagnose_recall.py --ckpt CKPT --device cuda --grid 16 32 64 \\
        --batch 2 --query-stride 4 --out benchmarks/results/diagnose_recall-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def critical_shares(q, k, scale, qi, theta, chunk=1 << 24):
    """[nq, S]: P_ij * crit_ij / critical mass_i for sampled queries qi (one head); and counts [nq]."""
    S = k.shape[0]
    n = max(1, chunk // S)
    out, cnt = [], []
    for c0 in range(0, qi.numel(), n):
        p = torch.softmax((q[qi[c0:c0 + n]] @ k.T) * scale, dim=-1)
        sp, order = torch.sort(p, dim=-1, descending=True)
        crit_sorted = (torch.cumsum(sp, -1) - sp) < theta
        crit = torch.zeros_like(crit_sorted).scatter_(-1, order, crit_sorted)
        w = p * crit
        out.append(w / w.sum(-1, keepdim=True).clamp_min(1e-30))
        cnt.append(crit.sum(-1))
    return torch.cat(out), torch.cat(cnt)


def best_rank_r(q, k, r):
    """(q_lr, k_lr) [S, r] with q_lr k_lr^T = best rank-r approximation of q k^T (Eckart-Young)."""
    qq, rq = torch.linalg.qr(q.double())
    qk, rk = torch.linalg.qr(k.double())
    u, s, vh = torch.linalg.svd(rq @ rk.T)
    root = s[:r].sqrt()
    return (qq @ (u[:, :r] * root)).float(), (qk @ (vh[:r].T * root)).float()


def block_reduce(x, block, how):
    """[..., S] -> [..., S/block] (sum or max over each block); identity for block 0."""
    if block == 0:
        return x
    x = x.reshape(*x.shape[:-1], -1, block)
    return x.sum(-1) if how == "sum" else x.amax(-1)


class Diagnoser:
    def __init__(self, args, cfg):
        self.args, self.cfg = args, cfg
        self.curves = defaultdict(lambda: 0.0)  # (layer, scorer, G, block) -> [H, items] recall curve, summed
        self.n = defaultdict(int)  # (layer) -> videos seen
        self.crit = defaultdict(lambda: 0.0)  # layer -> [H] mean critical count (summed over videos)
        self.cos = defaultdict(lambda: 0.0)  # (layer, scorer) -> [H] mean (1 - cosine) of score rows

    @torch.no_grad()
    def layer(self, mod, q, k, hidden):
        """q [B, H, S, D], k [B, Hkv, S, D] (post-RoPE), hidden [S, B, hidden] or None."""
        a, L = self.args, mod.layer_number
        B, H, S, D = q.shape
        if any(S % g for g in a.groups) or any(b and S % b for b in a.blocks):
            raise ValueError(f"S={S} must be divisible by every --groups and --blocks entry")
        gen = torch.Generator().manual_seed(1000 + L)
        for b in range(B):
            q_lr, k_lr = mod.predictor.project(q[b:b + 1], k[b:b + 1],
                                               None if hidden is None else hidden[:, b:b + 1])
            kf = k[b].repeat_interleave(H // k.shape[1], dim=0).float()
            qi = torch.arange(int(torch.randint(a.query_stride, (), generator=gen)), S, a.query_stride,
                              device=q.device)
            crit_counts = []
            for h in range(H):
                qh, kh = q[b, h].float(), kf[h]
                w, cnt = critical_shares(qh, kh, mod.softmax_scale * a.logit_scale, qi, a.theta)
                crit_counts.append(cnt.float().mean())
                src = {"exact": (qh, kh), "pred": (q_lr[0, h].float(), k_lr[0, h].float())}
                for r in a.svd_ranks:
                    src[f"svd{r}"] = best_rank_r(qh, kh, r)
                true_rows = qh[qi] @ kh.T
                for name, (qs, ks) in src.items():
                    if name != "exact":
                        cos = torch.nn.functional.cosine_similarity(qs[qi] @ ks.T, true_rows, dim=-1)
                        self.cos[(L, name)] = self.cos[(L, name)] + torch.zeros(H).index_fill_(
                            0, torch.tensor([h]), float((1 - cos).mean()))
                for G in a.groups:
                    gid = qi // G
                    ug, inv = torch.unique(gid, return_inverse=True)
                    nq = torch.bincount(inv).float()
                    wg = torch.zeros(ug.numel(), S, device=w.device).index_add_(0, inv, w) / nq[:, None]
                    proxies = {n: qs.reshape(S // G, G, -1).mean(1)[ug] for n, (qs, _) in src.items()}
                    for blk in a.blocks:
                        wi = block_reduce(wg, blk, "sum")  # [NGe, items] critical share per item
                        rank_by = {"oracle": wi}
                        for n, (_, ks) in src.items():
                            rank_by[n] = block_reduce(proxies[n] @ ks.T, blk, "max")
                        for n, sc in rank_by.items():
                            order = torch.argsort(sc, dim=-1, descending=True, stable=True)
                            curve = torch.cumsum(torch.gather(wi, 1, order), dim=1)
                            head = (curve * nq[:, None]).sum(0) / nq.sum()
                            key = (L, n, G, blk)
                            if not torch.is_tensor(self.curves[key]):
                                self.curves[key] = torch.zeros(H, head.numel(), dtype=torch.float64)
                            self.curves[key][h] += head.double().cpu()
            self.crit[L] = self.crit[L] + torch.stack(crit_counts).cpu()
            self.n[L] += 1
            self.S = S

    def budget_items(self, sparsity, mult, block):
        """Dispatcher budgets (times mult) in items: max(ceil(m (1-s) S), k_min) tokens, rounded up to the block."""
        S = self.S
        tok = torch.clamp(torch.maximum(torch.ceil(mult * (1 - sparsity.double()) * S - 1e-6 * S),
                                        torch.tensor(float(self.cfg.k_min))), max=S)
        return (tok if block == 0 else torch.ceil(tok / block)).long().clamp(min=1)

    def results(self):
        a, S, rows = self.args, self.S, []
        for (L, name, G, blk), c in sorted(self.curves.items(), key=lambda x: x[0]):
            curve = c / self.n[L]
            s = 1 - (self.crit[L] / self.n[L]) / S
            row = {"layer": L, "scorer": name, "G": G, "block": blk, "sparsity": s.tolist(),
                   "one_minus_cos": (self.cos[(L, name)] / self.n[L]).tolist() if (L, name) in self.cos else None}
            for m in a.mults:
                items = self.budget_items(s, m, blk).clamp(max=curve.shape[1])
                row[f"recall@{m:g}K"] = curve.gather(1, (items - 1)[:, None]).squeeze(1).tolist()
                row[f"budget@{m:g}K"] = (items * max(blk, 1)).clamp(max=S).div(S).tolist()
            need = (curve >= a.target - 1e-9).float().argmax(1) + 1  # first item count reaching the target
            row["k_target_frac"] = (need * max(blk, 1)).clamp(max=S).div(S).tolist()
            rows.append(row)
        return rows


def mean(x):
    return sum(x) / len(x)


def print_table(rows, args):
    by = defaultdict(list)
    for r in rows:
        by[(r["scorer"], r["G"], r["block"])].append(r)
    m0 = args.mults[0]
    dens = mean([1 - mean(r["sparsity"]) for r in rows])
    print(f"logit_scale={args.logit_scale:g}  S={args.S}  layers={len({r['layer'] for r in rows})}  theta={args.theta}  "
          f"mean critical density 1-s={dens:.3f}  recall target={args.target}")
    hdr = "".join(f" rec@{m:g}K" for m in args.mults)
    print(f"{'scorer':>7} {'G':>4} {'blk':>4} {'K/S@1x':>7}{hdr} {'min_L@1x':>8} {'K95/S':>6} {'1-cos':>6}")
    order = {"oracle": 0, "exact": 1, "pred": 99}
    for key in sorted(by, key=lambda k: (k[1], k[2], order.get(k[0], 50), k[0])):
        rs = by[key]
        recs = "".join(f" {mean([mean(r[f'recall@{m:g}K']) for r in rs]):8.3f}" for m in args.mults)
        per_layer = [mean(r[f"recall@{m0:g}K"]) for r in rs]
        cos = [mean(r["one_minus_cos"]) for r in rs if r["one_minus_cos"] is not None]
        print(f"{key[0]:>7} {key[1]:>4} {key[2]:>4} {mean([mean(r[f'budget@{m0:g}K']) for r in rs]):7.3f}{recs}"
              f" {min(per_layer):8.3f} {mean([mean(r['k_target_frac']) for r in rs]):6.3f}"
              f" {mean(cos) if cos else float('nan'):6.3f}")
    print("K/S@1x: dispatcher budget / S;  min_L: worst layer;  K95/S: budget for recall >= target "
          "(mean over heads, layers);  1-cos: score-row cosine loss vs true q k^T")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint dir (megatron_dsv.train --output-dir or --save)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="model dtype for the forward")
    p.add_argument("--grid", type=int, nargs=3, default=None, help="latent T H W (default: the model's)")
    p.add_argument("--batch", type=int, default=2, help="videos (each at its own flow time t)")
    p.add_argument("--t", type=float, nargs="*", default=None, help="flow times (default: spread over 0.2..0.8)")
    p.add_argument("--theta", type=float, default=None, help="critical mass (default: the checkpoint's)")
    p.add_argument("--logit-scale", type=float, default=1.0,
                   help="stress test: sharpen the true softmax by this factor (raises sparsity; rankings unchanged)")
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--query-stride", type=int, default=2, help="evaluate 1 query in N (random offset)")
    p.add_argument("--groups", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--blocks", type=int, nargs="+", default=[0, 64, 128], help="0 = token granularity")
    p.add_argument("--mults", type=float, nargs="+", default=[1.0, 1.5, 2.0], help="budget multipliers of K_h")
    p.add_argument("--svd-ranks", type=int, nargs="*", default=[16])
    p.add_argument("--cube", type=int, nargs=3, default=None,
                   help="analyse in this cube-major token order (t h w); default: the model's (attention is "
                        "permutation-equivariant, so any query-group cube can be studied on one checkpoint)")
    p.add_argument("--layers", type=int, nargs="*", default=None, help="layer numbers to analyse (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write rows + meta as JSON here")
    args = p.parse_args(argv)

    from megatron_dsv.attention import dsv_layers
    from megatron_dsv.data.synthetic import SyntheticVideoDataset
    from megatron_dsv.training.checkpointing import load_model_for_inference

    dev = torch.device(args.device)
    model, mcfg = load_model_for_inference(args.ckpt, dev, torch.bfloat16 if args.dtype == "bf16" else None)
    layers = dsv_layers(model)
    if not layers:
        raise SystemExit("checkpoint has no DSV layers")
    cfg = layers[0].dsv_config
    args.theta = cfg.theta if args.theta is None else args.theta
    diag = Diagnoser(args, cfg)
    T, Hh, W = args.grid or mcfg.latent_grid
    grid = mcfg.token_grid((T, Hh, W))
    reorder = None
    if args.cube and tuple(args.cube) != tuple(model.cube):
        from megatron_dsv.attention.grouping import cube_order_permutation

        inv = torch.argsort(cube_order_permutation(grid, model.cube))  # raster -> model order
        reorder = inv[cube_order_permutation(grid, args.cube)].to(dev)  # new order -> model token
    for mod in layers:
        if args.layers and mod.layer_number not in args.layers:
            continue
        orig = mod._attend

        def wrapped(q, k, v, keep, _mod=mod, _orig=orig):
            qa, ka, hid = q, k, _mod._hidden
            if reorder is not None:
                qa, ka = q[:, :, reorder], k[:, :, reorder]
                hid = None if hid is None else hid[reorder]
            diag.layer(_mod, qa, ka, hid)
            return _orig(q, k, v, keep)

        mod._attend = wrapped

    ds = SyntheticVideoDataset(args.batch, mcfg.in_channels, T, Hh, W, mcfg.num_classes, seed=args.seed)
    x0 = torch.stack([ds[i]["latents"] for i in range(args.batch)]).to(dev)
    labels = torch.stack([ds[i]["label"] for i in range(args.batch)]).to(dev)
    t = torch.tensor(args.t if args.t else [0.2 + 0.6 * i / max(1, args.batch - 1) for i in range(args.batch)],
                     device=dev)[:args.batch]
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(args.seed + 1)).to(dev)
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
    with torch.no_grad():
        model(x_t.to(next(model.parameters()).dtype), t, labels)
    args.S, args.model_cube = diag.S, list(model.cube)
    rows = diag.results()
    print_table(rows, args)
    if args.out:
        meta = {k: v for k, v in vars(args).items()}
        meta.update(model=mcfg.to_dict(), dsv=cfg.to_dict(), device=str(dev),
                    stage=int(layers[0].stage[0]), step=int(layers[0].step[0]))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
