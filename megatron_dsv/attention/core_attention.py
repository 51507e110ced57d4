"""DSVCoreAttention: Megatron-Core's core_attention contract, backed by DSV.

Contract (megatron-core 0.16.1 .. 0.19.x, DESIGN.md section 4): constructed by
``SelfAttention`` with the keywords ``config, layer_number, attn_mask_type,
attention_type, cp_comm_type, softmax_scale, pg_collection``;
``forward(query, key, value, attention_mask, *, attn_mask_type, attention_bias,
packed_seq_params)`` with q ``[sq, b, np, hn]``, k/v ``[sk, b, ng, hn]``
(GQA: ng divides np), RoPE already applied; returns ``[sq, b, np * hn]``.

The spec passes ``dsv_config`` (a DSVConfig) through ``ModuleSpec.params``.

What one forward does (q, k, v as ``[B, H, S, D]``):

* training with grad enabled: the predictor loss on sampled queries (1 in
  ``predictor_query_stride``) adds to the predictor's private gradient (see
  ``predictor.py`` for why the predictor trains outside the main optimizer);
  on profiler steps the exact per-head sparsity, the budget density the budget rule asks
  for (``budget_rule='recall'``: the list length where the recall curve of the estimator's
  lists reaches ``recall_target``) and the recall of the lists the dispatcher would use are
  measured on the same sampled queries; stage 2 trains the predictor every
  ``predictor_train_interval`` steps;
* stage 1, or a layer the dispatcher keeps dense: dense attention
  (:func:`megatron_dsv.ops.dense.dense_attention`, cuDNN first on GPU);
* stage 2 and a sparse layer: low-rank estimation (``estimate_topk``) then the sparse kernel;
* a padding mask: dense attention, and no predictor or profiler work on that batch
  (the sparse kernels take no masks; video DiTs do not pad).

Nothing changes state during a forward except gradient/statistics accumulators, so
activation recomputation reproduces the first pass exactly. Counters, the profiler's
smoothing, the stage switch and the predictor's Adam step happen in
:func:`megatron_dsv.attention.hooks.dsv_on_step_end`, with collectives that keep
every rank's state identical. All DSV state is in buffers (``state_dict`` and
``sharded_state_dict``, per-head tensors TP-sharded along heads); their layout, host mirrors,
step-end update and metrics are :class:`megatron_dsv.attention.state.LayerState`'s. Backends are
resolved once, here at construction (``attention/_ops.py``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dsv.attention import _ops
from megatron_dsv.attention.dispatcher import SpeedupTable, density_budgets, head_budgets, plan_layer
from megatron_dsv.attention.neighbourhood import local_item_lists, local_items_with_counts
from megatron_dsv.attention.predictor import LowRankPredictor, all_reduce_many
from megatron_dsv.attention.profiler import profile_stats, recall_density
from megatron_dsv.attention.schedule import is_profile_step, profile_thinning, sampled_queries, trains_predictor
from megatron_dsv.attention.state import PER_HEAD_STATE, LayerState
from megatron_dsv.config import DSVConfig
from megatron_dsv.ops.dense import dense_attention
from megatron_dsv.ops.sparse_attention.flex import flex_supported

__all__ = ["DSVCoreAttention", "SUPPORTED_MASK_TYPES", "PER_HEAD_STATE"]

SUPPORTED_MASK_TYPES = (AttnMaskType.no_mask, AttnMaskType.padding)


def _group_size(pg) -> int:
    return 1 if pg is None else pg.size()


def _group_mean(tensors, group):
    """Each tensor (None passes through) averaged over ``group``, in one float64 all-reduce."""
    present = [t.to(torch.float64, copy=True) for t in tensors if t is not None]
    all_reduce_many(present, group)
    summed, n = iter(present), dist.get_world_size(group)
    return tuple(None if t is None else (next(summed) / n).to(t.dtype) for t in tensors)


_STAGE1_LOGGED: set = set()


def _log_stage1_once(radius, cube, grid, kept: float) -> None:
    """One line per (radius, grid) and job, on rank 0: the window stage 1 attends and the share of keys it keeps."""
    if (radius, grid) in _STAGE1_LOGGED:
        return
    _STAGE1_LOGGED.add((radius, grid))
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f" [dsv] stage 1 attends a {tuple(radius)} window of {tuple(cube)} query cubes on token grid "
              f"{tuple(grid)}: {kept:.0%} of the keys (--dsv-stage1-local-radius; 0 0 0: dense)", flush=True)


class DSVCoreAttention(MegatronModule):
    """Core attention with DSV dynamic sparsity (non-causal, for DiTs)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        dsv_config: Optional[DSVConfig] = None,
    ):
        super().__init__(config=config)
        self.dsv_config = dsv_config if dsv_config is not None else DSVConfig()
        if not isinstance(self.dsv_config, DSVConfig):
            raise ValueError(f"dsv_config must be a DSVConfig, got {type(self.dsv_config).__name__}")
        self.layer_number = max(1, layer_number)
        self.attention_type = attention_type
        self._check_mask_type(attn_mask_type, "attn_mask_type")
        self.attn_mask_type = attn_mask_type
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout != 0.0:
            raise ValueError(f"DSV attention supports attention_dropout=0.0 only, got {dropout} "
                             "(set TransformerConfig.attention_dropout=0.0)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"DSV attention supports softmax_type='vanilla' only, got {config.softmax_type!r}")

        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = getattr(pg_collection, "tp", None)
        self.cp_group = getattr(pg_collection, "cp", None)
        tp = _group_size(self.tp_group)
        for name, count in (("num_attention_heads", config.num_attention_heads),
                            ("num_query_groups", config.num_query_groups)):
            if count % tp != 0:
                raise ValueError(f"TransformerConfig.{name} ({count}) must be divisible by the tensor-parallel size ({tp})")
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.cp_size = _group_size(self.cp_group)
        self.cp_ctx = None
        if self.cp_size > 1:
            if self.dsv_config.cp_mode == "none":
                raise ValueError(f"DSV attention with context_parallel_size={self.cp_size} needs DSVConfig.cp_mode "
                                 "(--dsv-cp-mode) in ('head', 'seq', 'hybrid'); got 'none'")
            from megatron_dsv.parallel.cp_attention import CPContext

            self.cp_ctx = CPContext.get(self.cp_group, self.num_heads, tp)
        # apply_query_key_layer_scaling only rescales inside fp16 softmax and cancels out: not needed here.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self._init_dsv_state(config, tp)

    def _init_dsv_state(self, config: TransformerConfig, tp: int):
        cfg = self.dsv_config
        if cfg.predictor_input == "hidden" and getattr(config, "sequence_parallel", False) and tp > 1:
            raise ValueError("DSVConfig.predictor_input='hidden' does not support sequence_parallel=True "
                             "(hidden states are sequence-sharded); use predictor_input='qk'")
        if (cfg.predictor_input == "hidden" and config.recompute_granularity == "selective"
                and "core_attn" in (config.recompute_modules or [])):
            raise ValueError("DSVConfig.predictor_input='hidden' cannot be combined with selective recomputation "
                             "of 'core_attn' (the recompute has no hidden states); use predictor_input='qk' or "
                             "drop 'core_attn' from recompute_modules")
        tp_rank = self.tp_group.rank() if self.tp_group is not None and tp > 1 else 0
        self.predictor = LowRankPredictor(cfg, self.num_heads, self.head_dim, config.hidden_size,
                                          self.layer_number, head_offset=tp_rank * self.num_heads,
                                          total_heads=config.num_attention_heads)
        # resolved once: the config, else the environment variables (read here, never per call)
        self.kernel_backend, self.topk_backend = _ops.resolve_backends(cfg)
        if self.kernel_backend == "flex" and not flex_supported(0, cfg.group_size, cfg.block_size):
            source = "DSVConfig.kernel_backend" if cfg.kernel_backend == "flex" else "DSV_SPARSE_ATTN_BACKEND"
            raise ValueError(f"{source}='flex' needs granularity='block' with query groups of 128 "
                             f"and kv_block_size=128 (the only shape flex lowers); got group_size={cfg.group_size}, "
                             f"block_size={cfg.block_size}")
        self.speedup_table = SpeedupTable.from_config(cfg, self.head_dim)
        # Kernels cover a fixed set of head dims; other models still train predictors and profile,
        # but the dispatcher keeps them dense (reported as kernel_ok=0 in the metrics).
        self.kernel_ok = self.head_dim in _ops.SUPPORTED_HEAD_DIMS
        # What the sparse kernel saves of v for backward (it saves v as it is handed, as torch SDPA does):
        # Megatron's v is a view of the fused QKV projection output. With q/k LayerNorm that buffer is saved
        # anyway (torch's LayerNorm saves its input, a view of it), so the view costs nothing and a
        # contiguous copy would be a second v; without q/k norms nothing else keeps the buffer (3x v) alive,
        # and the copy is the cheaper one to keep. (apex/TE norms save contiguous copies of q and k: there
        # the view keeps what dense SDPA keeps too.)
        # A model whose q/k norms copy their input (Wan's fp32 RMSNorm) says so in ``config.dsv_save_v_view``.
        self.save_v_view = bool(getattr(config, "dsv_save_v_view", getattr(config, "qk_layernorm", False)))
        # the buffers (stage, step, profiles, sparsity, budget_density, recall, predictor_loss and the
        # per-step accumulator 'pending'), their host mirrors and the step-end update: state.py
        self.dsv_state = LayerState(self.num_heads)
        self.dsv_state.register_buffers(self)
        # K used per head in the last forward: a host tensor (metrics only), so writing it never syncs
        self.last_k = torch.zeros(self.num_heads, dtype=torch.float32)
        self.last_sparse = False
        self._hidden = None  # set by DSVSelfAttention for predictor_input='hidden', only during its forward
        # Run-time switches, not state: benchmarks turn the method's own work off for an A/B of its cost,
        # force_dense runs the layer dense whatever the dispatcher says (bench_recall.py's baseline), and
        # force_stage1 attends as stage 1 does whatever the stage (bench_quality.py times stage 1 from a
        # stage-2 run: dense, or stage1_local_radius's window).
        self.predictor_training = True
        self.profiling = True
        self.force_dense = False
        self.force_stage1 = False
        # (T, H, W) of the patch tokens: set by the model on every forward (the video DiT does); needed by
        # local + predicted lists (DSVConfig.local_radius) only
        self.token_grid = None
        self._decisions = {}
        self.cp_plan = None  # the LayerPlan in use under context parallelism (cp_plan buffer: its checkpoint)
        self._sync_host()
        self._register_load_state_dict_pre_hook(LayerState.fill_missing_state)
        self.register_load_state_dict_post_hook(lambda module, keys: module._sync_host())

    def _sync_host(self):
        """Host copies of the state the forward branches on and the metrics read (read from the
        device once, at construction and after a load; the step end keeps them current)."""
        self.dsv_state.sync(self)
        self._decisions = {}
        if self.cp_size > 1:
            from megatron_dsv.parallel.cp_attention import decode_plan

            self.cp_plan = decode_plan(self.cp_plan_state.cpu())

    # host mirrors (LayerState): read by the forward, the analysis tools and the tests
    @property
    def stage_host(self) -> int:
        return self.dsv_state.stage

    @property
    def step_host(self) -> int:
        return self.dsv_state.step

    @property
    def profiled_host(self) -> bool:
        return self.dsv_state.profiled

    @property
    def _sparsity_cpu(self) -> torch.Tensor:
        return self.dsv_state.sparsity

    @property
    def _density_cpu(self) -> torch.Tensor:
        return self.dsv_state.density

    @property
    def _recall_cpu(self) -> torch.Tensor:
        return self.dsv_state.recall

    def _apply(self, fn, recurse=True):
        """Device moves apply to DSV state; dtype casts (Float16Module) leave fp32 state in fp32."""
        def keep_fp32(t):
            out = fn(t)
            if t.dtype == torch.float32 and out.dtype != torch.float32:
                return t.to(device=out.device)
            return out

        return super()._apply(keep_fp32, recurse)

    @staticmethod
    def _check_mask_type(mask_type, name: str):
        if mask_type not in SUPPORTED_MASK_TYPES:
            raise ValueError(f"DSV attention {name} must be one of "
                             f"{[m.name for m in SUPPORTED_MASK_TYPES]} (a DiT is non-causal), got {mask_type}")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """q ``[sq, b, np, hn]``, k/v ``[sk, b, ng, hn]`` -> ``[sq, b, np * hn]``."""
        if packed_seq_params is not None:
            raise ValueError("DSV attention does not support packed_seq_params (THD packing); pass None")
        if attention_bias is not None:
            raise ValueError("DSV attention does not support attention_bias; pass None")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        self._check_mask_type(mask_type, "attn_mask_type")
        self._check_shapes(query, key, value)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, hn]
        keep = self._keep_mask(attention_mask, mask_type, q.shape[0], q.shape[2], k.shape[2])
        out = self._attend(q, k, v, keep)  # [b, np, sq, hn]
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.num_heads * self.head_dim)

    def _attend(self, q, k, v, keep: Optional[torch.Tensor]) -> torch.Tensor:
        """Attention on ``[b, heads, s, hn]`` tensors; ``keep`` is a bool mask (True = attend) or None."""
        hidden, self._hidden = self._hidden, None
        if keep is not None:
            if self.cp_size > 1:
                raise ValueError("a padding attention_mask is not supported under context parallelism (the keys are "
                                 "sharded over the CP group); pass attention_mask=None (video DiTs do not pad) or "
                                 "use context_parallel_size=1")
            self.last_sparse = False
            return dense_attention(q, k, v, softmax_scale=self.softmax_scale, attn_mask=keep)
        if self.cp_size > 1:
            return self._attend_cp(q, k, v, hidden)
        S = k.shape[2]
        # grad mode on = the pass whose backward runs: reentrant recompute trains once, eval never
        learn = self.training and torch.is_grad_enabled()
        cfg = self.dsv_config
        train = learn and self.predictor_training and trains_predictor(self.step_host, self.stage_host, cfg)
        profile = learn and self.profiling and is_profile_step(self.step_host, cfg)
        qidx = None  # sampled queries: only the passes that train or profile need them
        if train or profile:
            qidx = sampled_queries(S, cfg.predictor_query_stride, self.step_host, q.device)
        if train:  # statistics only: dsv_on_step_end trains every layer's predictor in one batch
            self.predictor.collect(q, k, hidden, qidx)
        sparse, budgets, tokens = self.decide(S)
        lists = None
        if profile:
            pidx = qidx[::profile_thinning(qidx.numel(), cfg.profile_max_queries)]
            lists = self._profile(q, k, hidden, pidx, budgets if sparse else None)
        elif sparse:
            lists = self._estimate(q, k, hidden, budgets)
        self.last_sparse = sparse
        self.last_k.copy_(tokens)
        if not sparse:
            window = self._stage1_window(S, q.device)
            if window is None:
                return dense_attention(q, k, v, softmax_scale=self.softmax_scale)
            lists, counts, keys = window
            self.last_k.fill_(keys)
            B, H = q.shape[:2]
            return _ops.run_sparse_attention(self.kernel_backend, q, k, self._v_for_kernel(v),
                                             lists.expand(B, H, *lists.shape), counts.expand(B, H, -1),
                                             cfg.group_size, cfg.block_size, self.softmax_scale)
        idx, counts = lists
        return _ops.run_sparse_attention(self.kernel_backend, q, k, self._v_for_kernel(v), idx, counts,
                                         cfg.group_size, cfg.block_size, self.softmax_scale)

    def _v_for_kernel(self, v: torch.Tensor) -> torch.Tensor:
        """v as the sparse kernel should save it for backward (see ``save_v_view``)."""
        return v if self.save_v_view else v.contiguous()

    def _attend_cp(self, q, k, v, hidden) -> torch.Tensor:
        """:meth:`_attend` on this CP rank's sequence shard (q, k, v ``[b, heads, s, hn]``).

        The method's own work runs on the shard, for all heads, and sees the whole sequence through
        small collectives: the predictor's sequence moments are summed over the CP group, the
        low-rank q and k (rank r) are gathered so the lists are exactly those one GPU would build, and
        profile steps gather q and k once (no V) for the exact oracle. Each rank measures its own
        sampled queries; the step end averages ranks like data-parallel replicas. The attention
        itself follows the layer's :class:`~megatron_dsv.parallel.planner.LayerPlan`
        (:func:`~megatron_dsv.parallel.cp_attention.cp_attention`)."""
        from megatron_dsv.parallel.collectives import gather_seq
        from megatron_dsv.parallel.cp_attention import cp_attention

        cfg, cp, rank = self.dsv_config, self.cp_size, self.cp_ctx.cp_rank
        s = k.shape[2]
        S = s * cp
        learn = self.training and torch.is_grad_enabled()
        train = learn and self.predictor_training and trains_predictor(self.step_host, self.stage_host, cfg)
        profile = learn and self.profiling and is_profile_step(self.step_host, cfg)
        qidx = pidx = None  # this rank's share of the sampled (and profiled) queries, as global positions
        thin = 1
        if train or profile:
            qidx = sampled_queries(S, cfg.predictor_query_stride, self.step_host, q.device)
            thin = profile_thinning(qidx.numel(), cfg.profile_max_queries) if profile else 1
            pidx = qidx[::thin]  # the queries one process would profile
            qidx, pidx = (t[(t >= rank * s) & (t < (rank + 1) * s)] for t in (qidx, pidx))
        self._check_cp_shard(s, sampling=train or profile, thin=thin)
        if train:
            self.predictor.collect(q, k, hidden, qidx - rank * s, seq_group=self.cp_group)
        sparse, budgets, tokens = self.decide(S)
        lists = None
        if profile or sparse:
            with torch.no_grad():
                projected = tuple(gather_seq(t, self.cp_group)
                                  for t in self.predictor.project(q, k, hidden, dtype=q.dtype))
                if profile:
                    q_all, k_all = gather_seq(q.detach(), self.cp_group), gather_seq(k.detach(), self.cp_group)
                    lists = self._profile(q_all, k_all, None, pidx, budgets if sparse else None, projected,
                                          seq_group=self.cp_group)
                else:
                    lists = self._estimate(None, None, None, budgets, projected)
        self.last_sparse = sparse
        self.last_k.copy_(tokens)
        ng = s // cfg.group_size
        mine = slice(rank * ng, (rank + 1) * ng)  # this shard's query groups
        run = None  # the lists this shard attends through (None: dense attention)
        if sparse:  # per-cube lengths (local_mode 'window') are sliced with their lists
            idx, counts = lists
            run = (idx[:, :, mine].contiguous(), counts[:, :, mine].contiguous() if counts.dim() == 3 else counts)
        elif (window := self._stage1_window(S, q.device)) is not None:  # the whole sequence's window, sliced
            idx, counts, keys = window
            self.last_k.fill_(keys)
            tokens = torch.full_like(tokens, keys)
            B, H = q.shape[:2]
            run = (idx[mine].expand(B, H, ng, -1), counts[mine].expand(B, H, ng))
        plan = self._plan_cp(S, run is not None, tokens)

        def sparse_fn(qq, kk, vv, idx, counts):
            return _ops.run_sparse_attention(self.kernel_backend, qq, kk, self._v_for_kernel(vv), idx, counts,
                                             cfg.group_size, cfg.block_size, self.softmax_scale)

        return cp_attention(q, k, v, self.cp_ctx, plan, lists=run, group_size=cfg.group_size,
                            block_size=cfg.block_size, softmax_scale=self.softmax_scale, sparse_fn=sparse_fn)

    def _check_cp_shard(self, s: int, sampling: bool = False, thin: int = 1) -> None:
        """A CP shard of ``s`` tokens holds whole query groups (and key blocks); when the pass samples
        queries (predictor training, profiling) every shard holds the same number of them, or the CP
        ranks' averaged statistics would weight queries unequally and differ from one process's."""
        cfg = self.dsv_config
        unit = max(cfg.group_size, cfg.block_size)
        if s % unit:
            block = (f" and of DSVConfig.kv_block_size (--dsv-kv-block-size) = {cfg.block_size} key tokens"
                     if cfg.block_size else "")
            raise ValueError(f"context parallelism: each CP rank's sequence shard ({s} tokens) must be a multiple of "
                             f"the query group, DSVConfig.query_group_shape (--dsv-query-group-shape) "
                             f"{'x'.join(map(str, cfg.query_group_shape))} = {cfg.group_size} tokens{block}: a CP "
                             "shard never splits a query-group cube or a key block")
        if sampling and s % cfg.predictor_query_stride:
            raise ValueError(f"context parallelism: each CP rank's sequence shard ({s} tokens) must be a multiple of "
                             f"DSVConfig.predictor_query_stride (--dsv-predictor-query-stride) = "
                             f"{cfg.predictor_query_stride} in training, so every CP rank samples the same number "
                             "of queries for the predictor and the profiler (their statistics are averaged over "
                             "the CP ranks); pick a stride that divides the shard")
        if sampling and thin > 1 and s % (cfg.predictor_query_stride * thin):
            raise ValueError(f"context parallelism: this profile keeps one in {thin} of the sampled queries "
                             f"(DSVConfig.profile_max_queries (--dsv-profile-max-queries) = "
                             f"{cfg.profile_max_queries}), so each CP rank's sequence shard ({s} tokens) must be a "
                             f"multiple of predictor_query_stride x {thin} = {cfg.predictor_query_stride * thin} "
                             "for every rank to profile the same number of queries; raise "
                             "--dsv-profile-max-queries (0: no cap)")

    def _plan_cp(self, S: int, sparse: bool, tokens: torch.Tensor):
        """The layer's CP plan for this step's decision (planned again whenever the decision is new,
        i.e. after every profile update; logged when it changes; kept in the ``cp_plan_state`` buffer).
        An eval forward (validation, analysis) plans for itself, costed forward-only, and leaves the
        training plan, its log and its checkpointed state alone."""
        from megatron_dsv.parallel.cp_attention import encode_plan, plan_for_layer

        key = ("cp_plan", S, sparse, tuple(tokens.tolist()), self.training)
        plan = self._decisions.get(key)
        if plan is None:
            plan = self._decisions[key] = plan_for_layer(self, S, sparse, tokens)
        # the plan in use (kept across steps now: lengths alternating S1, S2, S1 switch it back from the cache)
        if self.training and plan is not self.cp_plan:
            if self.cp_plan is None or plan.describe() != self.cp_plan.describe():
                if dist.get_rank() == 0:
                    print(f" [dsv layer {self.layer_number}] CP plan: {plan.describe()}", flush=True)
            self.cp_plan = plan
            self.cp_plan_state.copy_(encode_plan(plan, self.num_heads).to(self.cp_plan_state.device))
        return plan

    def decide(self, S: int):
        """``(sparse, budgets, tokens)`` for sequence length S (cached until the state changes)."""
        key = (S, self.training, self.force_dense, self.force_stage1, self.token_grid)
        if key not in self._decisions:
            cfg = self.dsv_config
            ok, budgets, tokens = plan_layer(self._sparsity_cpu, self._density_cpu, S, cfg, self.speedup_table,
                                             self.training, self._local_tokens(S))
            sparse = (self.stage_host == 2 and self.profiled_host and self.kernel_ok and S >= cfg.group_size and ok
                      and not self.force_dense and not self.force_stage1)
            if cfg.local_mode == "window":  # keys a query attends: the mean neighbourhood itself, not its round-up
                excess = self._local_mean_items(S) - self._local_mean_items(S, exact=True)
                tokens = tokens.double() - excess * max(1, cfg.block_size)
            if not sparse:
                tokens = torch.full_like(tokens, S)
            self._decisions[key] = (sparse, budgets, tokens.float())
        return self._decisions[key]

    def _stage1_window(self, S: int, device):
        """``(lists [NG, F], counts [NG], mean keys)`` of stage 1's window (``DSVConfig.stage1_radius_for`` this
        sequence's grid) when this forward attends as stage 1 does and the window applies (else None: dense
        attention); a layer the dispatcher keeps dense in stage 2, ``force_dense`` and a head dim the kernels lack
        stay dense."""
        if self.force_dense or not self.kernel_ok or not (self.stage_host == 1 or self.force_stage1):
            return None
        grid = self.token_grid if self.token_grid is not None and math.prod(self.token_grid) == S else None
        key = ("stage1_window", S, grid, str(device))  # every stage-1 forward asks: built once per grid
        if key not in self._decisions:
            self._decisions[key] = self._build_stage1_window(S, grid, device)
        return self._decisions[key]

    def _build_stage1_window(self, S: int, grid, device):
        """:meth:`_stage1_window` for a sequence of ``S`` tokens on ``grid`` (None: not known)."""
        cfg = self.dsv_config
        radius = cfg.stage1_radius_for(grid)
        if radius is None:
            return None
        if grid is None:  # an explicit radius (auto needs the grid)
            raise ValueError(f"DSVConfig.stage1_local_radius (--dsv-stage1-local-radius) {radius} needs the token "
                             f"grid (T, H, W) of this sequence of {S} tokens on DSVCoreAttention.token_grid (the "
                             f"video DiT sets it on every forward); got {self.token_grid}")
        try:
            lists, counts, mean_items = local_items_with_counts(grid, cfg.query_group_shape, radius, cfg.block_size,
                                                                device)
        except ValueError as err:  # the neighbourhood's own check, with the flags that set it
            raise ValueError(f"DSVConfig.stage1_local_radius (--dsv-stage1-local-radius) needs a token grid the query "
                             f"cube tiles (query_group_shape, --dsv-query-group-shape {cfg.query_group_shape}; "
                             f"or 0 0 0, a dense stage 1): {err}") from err
        keys = min(float(S), mean_items * max(1, cfg.block_size))
        _log_stage1_once(radius, cfg.query_group_shape, grid, keys / S)
        return lists, counts, keys

    def _local_items(self, S: int, device) -> Optional[torch.Tensor]:
        """The local part of local + predicted lists (``[NG, F]`` items, -1 padded), or None when off."""
        cfg = self.dsv_config
        grid = self.token_grid if self.token_grid is not None and math.prod(self.token_grid) == S else None
        radius = cfg.local_radius_for(grid, self.topk_backend)  # DSV_TOPK_BACKEND=cuda: no local part
        if radius is None:
            return None
        if grid is None:
            raise ValueError(f"DSVConfig.local_radius (--dsv-local-radius) {cfg.local_radius} needs the token grid "
                             f"(T, H, W) of this sequence of {S} tokens on DSVCoreAttention.token_grid (the video DiT "
                             f"sets it on every forward); got {self.token_grid}")
        return local_item_lists(grid, cfg.query_group_shape, radius, cfg.block_size, device)

    def rule_budgets(self, S: int, density: Optional[torch.Tensor] = None, sparsity: Optional[torch.Tensor] = None):
        """``(budgets, tokens)`` (host ``[H]``) by the budget rule, from per-head ``density`` (rule 'recall') or
        ``sparsity`` (rule 'sparsity'), the layer's smoothed state where not given; floored at the
        neighbourhood of local + predicted lists. The one place budgets are sized outside the dispatcher."""
        cfg = self.dsv_config
        floor = self._local_tokens(S)
        if cfg.budget_rule == "recall":
            return density_budgets(self._density_cpu if density is None else density, S, cfg, floor)
        return head_budgets(self._sparsity_cpu if sparsity is None else sparsity, S, cfg, floor)

    def _local_tokens(self, S: int) -> int:
        """The floor of every budget under local + predicted lists, in keys: the largest neighbourhood
        (``local_mode`` 'shared'), or the mean one rounded up to whole items ('window')."""
        local = self._local_items(S, "cpu")
        if local is None:
            return 0
        items = self._local_mean_items(S) if self.dsv_config.local_mode == "window" else local.shape[1]
        return min(S, items * max(1, self.dsv_config.block_size))

    def _local_mean_items(self, S: int, exact: bool = False):
        """The neighbourhood's mean size over the cubes, in items (key blocks, or keys), rounded up (``exact``: not
        rounded, a float): what ``local_mode`` 'window' takes off each head's budget before the predicted part."""
        key = ("local_mean", S, self.token_grid)  # every forward asks: computed once per grid
        if key not in self._decisions:
            local = self._local_items(S, "cpu")
            self._decisions[key] = 0.0 if local is None else (local >= 0).sum(1).double().mean().item()
        mean = self._decisions[key]
        return mean if exact else math.ceil(mean - 1e-9)

    @torch.no_grad()
    def _estimate(self, q, k, hidden, budgets, projected=None):
        cfg = self.dsv_config
        q_lr, k_lr = projected if projected is not None else self.predictor.project(q, k, hidden, dtype=q.dtype)
        # budgets stay on the host: the estimator needs Kmax there, and a device copy read back
        # would cost two stream syncs per layer
        S = k_lr.shape[2]
        forced = self._local_items(S, q_lr.device)
        budgets, extra = budgets.cpu(), forced is not None and cfg.local_mode == "window"
        if extra:  # local_mode 'window': every cube keeps its whole neighbourhood; the budget's rest is predicted
            budgets = (budgets - self._local_mean_items(S)).clamp(min=0)
        return _ops.run_estimate_topk(self.topk_backend, q_lr, k_lr, budgets, cfg.group_size, cfg.block_size,
                                      cfg.group_proxy, cfg.block_score, forced, forced_extra=extra)

    @torch.no_grad()
    def _profile(self, q, k, hidden, qidx, budgets, projected=None, seq_group=None):
        """Exact per-head sparsity, the budget density the budget rule asks for, and the recall of
        the lists actually built, all on the sampled queries.

        ``budgets`` are the dispatcher's (a sparse layer); otherwise the lists are built from the
        smoothed state (or this measurement, before the first smoothing) to show what stage 2 would get.
        The logged recall is measured on those lists with the oracle, never read off the curve.
        Under context parallelism (``seq_group``) ``qidx`` is this rank's share of the sampled queries;
        the measurements are averaged over the group before the budget is read off the curve, so
        every rank takes the value one GPU measuring all sampled queries would.
        """
        cfg, S = self.dsv_config, k.shape[2]
        if projected is None:
            projected = self.predictor.project(q, k, hidden, dtype=q.dtype)
        recall_rule = cfg.budget_rule == "recall"
        curve_args = dict(q_lr=projected[0], k_lr=projected[1], group_size=cfg.group_size,
                          block_size=cfg.block_size, proxy=cfg.group_proxy, block_score=cfg.block_score,
                          forced=self._local_items(S, k.device)) if recall_rule else None
        stats = dict(theta=cfg.theta, softmax_scale=self.softmax_scale, query_index=qidx)
        if budgets is None and self.profiled_host:
            budgets = self.rule_budgets(S)[0]
        if budgets is not None:  # the lists are known before the pass: one pass measures everything
            lists = self._estimate(q, k, hidden, budgets, projected)
            sparsity, curve, recall = profile_stats(q, k, **stats, curve=curve_args,
                                                    lists=(lists[0], lists[1], cfg.group_size, cfg.block_size))
        else:  # first profile: the budgets come from this very measurement, then a second pass
            sparsity, curve, recall = profile_stats(q, k, **stats, curve=curve_args)
        if seq_group is not None:
            sparsity, curve, recall = _group_mean((sparsity, curve, recall), seq_group)
        measured = sparsity.float().mean(0)
        density = self._recall_density(curve, S) if recall_rule else 1.0 - measured
        if budgets is None:
            budgets = self.rule_budgets(S, density=density.cpu(), sparsity=measured.cpu())[0]
            lists = self._estimate(q, k, hidden, budgets, projected)
            recall = profile_stats(q, k, **stats, lists=(lists[0], lists[1], cfg.group_size, cfg.block_size))[2]
            if seq_group is not None:
                (recall,) = _group_mean((recall,), seq_group)
        self.dsv_state.layout.add_profile(self.pending, measured, recall.float().mean(0), density)
        return lists

    def _recall_density(self, curve: torch.Tensor, S: int) -> torch.Tensor:
        """Per head (float32 ``[H]``): the budget density the recall curve asks for (profiler.py)."""
        return recall_density(curve, S, self.dsv_config)

    # ---- step-end logic (called by hooks.dsv_on_step_end, after the collectives) --------------
    def finish_step(self, pending: torch.Tensor, step: int, stage: int) -> None:
        """Apply one step's DP-summed accumulators; set the step and (already agreed) stage.

        ``pending`` is a host copy (``hooks.dsv_on_step_end`` fetches every layer's in one copy):
        the smoothing runs on the host mirrors, and the device state is written from them, so no
        value is read back from the device here. The dispatcher's decisions are kept unless a profile or
        a stage switch changed what they are made from (a plain step changes neither).
        """
        if self.dsv_state.finish_step(self, pending, step, stage, self.dsv_config.sparsity_momentum):
            self._decisions = {}

    def predictor_lr(self) -> float:
        cfg = self.dsv_config
        return cfg.predictor_lr * (cfg.predictor_lr_stage2_scale if self.stage_host == 2 else 1.0)

    def metrics(self) -> dict:
        """Flat per-layer and per-head scalars (host floats) under ``dsv/layer{n}/``."""
        return self.dsv_state.metrics(f"dsv/layer{self.layer_number}/", self.last_sparse, self.last_k,
                                      self.kernel_ok)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """DSV state for dist_checkpointing: per-head tensors TP-sharded on dim 0, scalars replicated."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        state = {}
        self._save_to_state_dict(state, "", keep_vars=True)
        state.update(self.predictor.state_dict(prefix="predictor.", keep_vars=True))
        axis = {name: 0 for name in state if name in PER_HEAD_STATE or name.startswith("predictor.")}
        axis.pop("predictor.adam_steps", None)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])

    def _check_shapes(self, query, key, value):
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError("query, key, value must be [s, b, heads, head_dim]; got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        if query.shape[2] != self.num_heads or query.shape[3] != self.head_dim:
            raise ValueError(f"query must be [sq, b, {self.num_heads}, {self.head_dim}], got {tuple(query.shape)}")
        if key.shape != value.shape:
            raise ValueError(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
        if key.shape[1] != query.shape[1] or key.shape[3] != self.head_dim:
            raise ValueError(f"key must be [sk, {query.shape[1]}, ng, {self.head_dim}], got {tuple(key.shape)}")
        if self.num_heads % key.shape[2] != 0:
            raise ValueError(f"key/value heads ({key.shape[2]}) must divide query heads ({self.num_heads})")

    @staticmethod
    def _keep_mask(attention_mask, mask_type, b: int, sq: int, sk: int) -> Optional[torch.Tensor]:
        """Megatron masks are True where attention is *blocked*; SDPA wants True = attend."""
        if mask_type == AttnMaskType.no_mask or attention_mask is None:
            return None
        if attention_mask.dtype != torch.bool:
            raise ValueError(f"attention_mask must be a bool tensor (True = masked out), got {attention_mask.dtype}")
        if attention_mask.dim() != 4 or attention_mask.shape[-1] != sk or attention_mask.shape[0] not in (1, b):
            raise ValueError(f"padding attention_mask must be [b, 1, 1 or sq, sk] = [{b}, 1, 1|{sq}, {sk}], "
                             f"got {tuple(attention_mask.shape)}")
        return ~attention_mask

