"""DSVConfig: every knob of the DSV method, documented and validated.

Defaults follow DESIGN.md section 1 (the DSV paper and its public artifact).
``arguments.py`` turns each field into a ``--dsv-<field>`` flag, so the help
text of a flag is the ``help`` metadata below: one source of truth.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

__all__ = ["DSVConfig", "PREDICTOR_INPUTS", "STAGE_SWITCH_RULES", "GRANULARITIES", "KERNEL_BACKENDS",
           "TOPK_BACKENDS", "CP_MODES", "GROUP_PROXIES", "BLOCK_SCORES", "BUDGET_RULES"]

PREDICTOR_INPUTS = ("qk", "hidden")
STAGE_SWITCH_RULES = ("loss", "steps", "loss_or_steps", "loss_and_steps")
GRANULARITIES = ("token", "block")
KERNEL_BACKENDS = ("auto", "triton", "flex", "naive")
TOPK_BACKENDS = ("auto", "cuda", "triton", "naive")
CP_MODES = ("none", "head", "seq", "hybrid")
GROUP_PROXIES = ("mean", "middle")
BLOCK_SCORES = ("max", "lse")
BUDGET_RULES = ("recall", "sparsity")
LOCAL_MODES = ("shared", "window")
SUPPORTED_GROUP_SIZES = (16, 32, 64, 128)
# the neighbourhood (rt, rh, rw) in query cubes that local_radius=None (auto) gives where it applies
DEFAULT_LOCAL_RADIUS = (1, 1, 1)
# the 3D window (rt, rh, rw) in query cubes that stage1_local_radius=None (auto) gives stage 1 where it applies
DEFAULT_STAGE1_LOCAL_RADIUS = (2, 2, 1)
SUPPORTED_KV_BLOCKS = (64, 128)


def _knob(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class DSVConfig:
    """Configuration of DSV sparse attention (one instance shared by every layer)."""

    # ---- low-rank predictor -------------------------------------------------
    predictor_rank: int = _knob(16, "Rank r per head of the low-rank predictor (q_lr, k_lr have r features).")
    """Rank r per head of the low-rank predictor."""
    predictor_input: str = _knob(
        "qk", "Predictor input: 'qk' = post-RoPE q and k per head (D -> r, sees positions); "
        "'hidden' = the layer's hidden states (hidden -> 2*H*r, the paper).", choices=PREDICTOR_INPUTS)
    """What the predictor projects: per-head post-RoPE q/k, or the layer's hidden states."""
    predictor_loss_cos_weight: float = _knob(0.9, "Weight of (1 - cosine) in the predictor loss.")
    """Weight of the (1 - cosine similarity) term of the predictor loss."""
    predictor_loss_mse_weight: float = _knob(0.1, "Weight of the MSE of L2-normalised score rows in the predictor loss.")
    """Weight of the MSE-of-normalised-rows term of the predictor loss."""
    predictor_query_stride: int = _knob(64, "Predictor loss and profiler sample 1 query in this many.")
    """The predictor loss and the profiler use one query in this many."""
    predictor_lr: float = _knob(1e-3, "Learning rate of the predictors' own Adam optimizer (stage 1).")
    """Learning rate of the predictors' own optimizer during stage 1."""
    predictor_lr_stage2_scale: float = _knob(0.1, "Predictor learning-rate multiplier once stage 2 starts.")
    """Predictors keep learning in stage 2 at this fraction of predictor_lr."""
    predictor_train_interval: int = _knob(
        1, "Stage 2 trains the predictors every this many steps (0: never); stage 1 trains every step.")
    """Predictor training period in stage 2 (steps; 0 switches stage-2 training off).

    Stage 1 always trains (stage 2 starts by :attr:`stage_switch_rule`). In stage 2 the
    predictor only has to track slow drift, so training every N-th step divides its cost by N.
    The loss logged on a step without training is the last one measured."""

    # ---- profiler -----------------------------------------------------------
    theta: float = _knob(0.9, "Softmax mass a query's critical set must reach (0 < theta < 1).")
    """A query's critical set is the smallest key set holding theta of its softmax mass."""
    profile_interval: int = _knob(25, "Profile exact per-head sparsity every this many steps during warm-up.")
    """Profiler period (steps) during warm-up."""
    profile_interval_after_warmup: int = _knob(100, "Profiler period after warm-up.")
    """Profiler period (steps) after warm-up."""
    profile_warmup_steps: int = _knob(1000, "Steps of warm-up that use profile_interval.")
    """Number of steps profiled at the short period."""
    profile_max_queries: int = _knob(
        1024, "Profile at most this many of the sampled queries per sequence (evenly thinned; 0: all of them).")
    """The profiler's exact oracle costs (sampled queries) x S: with one query in ``predictor_query_stride``
    it grows as S^2 like attention itself (a profile step at 128K tokens costs about one more dense step,
    H200). A fixed number of queries keeps the sparsity and recall estimates as precise (their spread over
    queries, not S, sets the error) and the cost linear in S. Default 1024: no change up to 64K tokens at
    stride 64, half the cost at 128K, an eighth at 512K."""
    sparsity_momentum: float = _knob(0.9, "Momentum of the smoothed per-head sparsity (0 <= m < 1).")
    """Exponential smoothing of the profiled sparsity: s = m * s + (1 - m) * measured."""

    # ---- two-stage schedule -------------------------------------------------
    stage_switch_rule: str = _knob(
        "steps", "When stage 2 (sparse) starts: on the loss rule, the step rule, either, or both.",
        choices=STAGE_SWITCH_RULES)
    """Which rule moves training from stage 1 to stage 2 (sparse lists from the predictors).

    Default 'steps' at :attr:`stage_switch_steps`: the schedule every quality study of the default trained
    (benchmarks/NOTES_quality.md runs 10-22). The loss rule alone seldom fires: over the 4,046 layer profiles
    the committed recall and emergence benchmarks recorded, the predictor loss had a median of 0.079 and a minimum
    of 0.0087, against the rule's 0.01, so 'loss' or a 'loss_or_steps' without a step would leave most runs in
    stage 1 (the window) for good."""
    stage_switch_loss: float = _knob(0.01, "Loss rule: mean predictor loss over layers below this.")
    """Loss rule threshold on the mean predictor loss over layers."""
    stage_switch_steps: Optional[int] = _knob(400, "Step rule: switch after this many steps (None: never by steps).")
    """Step rule: the step at which stage 2 starts (None disables the rule).

    Default 400, the step at which the default's quality was measured (stage 2 from step 400 at 16K, 32K and 64K
    tokens, 1000-6000 steps in all: NOTES_quality.md runs 10-22); the predictors keep training in stage 2
    (:attr:`predictor_train_interval`), and the always-on neighbourhood and the 25% cap bound what an early list
    can miss. Runs much longer than these may switch later at no quality risk measured here, only at the window's
    step time for longer."""
    stage1_local_radius: Optional[Tuple[int, int, int]] = _knob(
        None, "What stage 1 attends: rt rh rw = only the keys of the query cubes within that many cubes of each query "
        "cube (a 3D window), through the sparse kernel; 0 0 0 = every key (dense, the paper's stage 1). None (auto): "
        "2 2 1 where the model gives a token grid the query cube tiles (the video DiT), lists are key blocks and the "
        "window keeps at most 1 - sparsity_threshold of the keys; dense elsewhere (text, short videos). The "
        "predictors learn from the sampled queries' exact scores either way.")
    """A 3D window in stage 1 instead of dense attention (``(0, 0, 0)``: dense, the paper's schedule).

    The predictors never learn from the attention the model runs: they fit the exact scores of the sampled queries
    (:meth:`LowRankPredictor.collect`), and the profiler measures the exact sparsity on them, so stage 1 needs
    dense attention only if the model's own training does. The neighbourhood is the local + predicted lists'
    (:func:`megatron_dsv.attention.neighbourhood.local_item_lists`, edge cubes keep fewer keys); under context
    parallelism each rank attends its query cubes' slice of it.

    Default None resolves per sequence (:meth:`stage1_radius_for`) to :data:`DEFAULT_STAGE1_LOCAL_RADIUS`, a radius
    in cubes, so the window keeps a shrinking share of a longer sequence's keys (with 4x4x8 cubes on 256x256 video:
    29 / 18 / 10 / 5% at 16K / 32K / 64K / 128K tokens, ``neighbourhood.kept_fraction``); where it would keep more
    than ``1 - sparsity_threshold`` (as dense as a stage-2 layer may be and still run sparse) stage 1 stays dense.
    Measured on the H200 / H100 quality frontier (benchmarks/NOTES_quality.md runs 10-16: 4 layers of hidden 512,
    (2, 2, 1) for 400 steps, then the capped lists; validation loss against full attention at equal steps, mean +- se
    over seeds): ViZDoom 16K -2.04 +- 0.42% at 3000 steps (8 seeds, runs 10, 14, 15; the same schedule with a dense
    stage 1: -0.20 +- 0.34%, 4 seeds), footage 16K -6.95 +- 1.51% (5 seeds, 1024 training clips, run 16; with 256
    clips -5.24 +- 4.42%, 4 seeds), ViZDoom trained at 32K -3.80 +- 0.66% at step 1750 (2 seeds), reaching full
    attention's loss in 0.47x its time at 32K; at 64K -2.65 +- 0.64% at step 1000 (4 seeds, runs 20-22, H100), steps
    1-1000 in 0.41-0.46x full attention's time. Unmeasured in quality beyond 64K."""

    # ---- dispatcher ---------------------------------------------------------
    budget_rule: str = _knob(
        "sparsity", "Per-head KV budget rule: 'sparsity' = (1 - s_h) * S tokens (the paper's), floored at the "
        "local neighbourhood; 'recall' = the smallest list length whose predicted lists reach recall_target "
        "of the critical mass on the profiled queries.",
        choices=BUDGET_RULES)
    """How the dispatcher sizes each head's KV list.

    'sparsity' (the paper): ``K_h = (1 - s_h) * S`` tokens. For key blocks shared by a query cube its lists
    alone hold only 0.44 of the critical mass and cost +0.66 +- 0.28% validation loss (H200 frontier,
    benchmarks/NOTES_quality.md run 2); with the always-on neighbourhood (``local_radius``, on by default
    for the video DiT) they hold 0.57 and come out at -0.49 +- 0.38% (run 3, the same settings: +0.34 +- 0.14%;
    paired against the rule alone in run 2: -1.15 +- 0.10%): the default. 'recall': at each
    profile step the recall curve of the lists the estimator would build is measured per head and ``K_h``
    is where it reaches ``recall_target``; the budget density ``K_h / S`` (rising at once, falling with
    ``sparsity_momentum``) then decides sparse vs dense. At targets of 0.9 and above its budgets kept
    55-66% of the keys in every model trained here, so no layer ran sparse."""
    recall_target: float = _knob(0.96, "Budget rule 'recall': recall of the critical mass each head's lists "
                                 "must reach on the profiled queries (0 < target <= 1).")
    """Target recall of the theta-critical mass for the 'recall' budget rule."""
    sparsity_threshold: float = _knob(
        0.7, "A layer runs sparse when its sparsity is at least this: the smoothed sparsity (budget_rule "
        "'sparsity') or 1 - mean(K_h) / S of its budgets (budget_rule 'recall').")
    """Minimum sparsity for a layer to run sparse (rule 'recall': the effective sparsity of its budgets).

    Default 0.7 (H200 frontier run 3, benchmarks/NOTES_quality.md: 16K tokens, 4 layers, 2 seeds, 1750 steps,
    with the neighbourhood): at 0.8 two of four layers stayed dense (46% of stage-2 layer-steps sparse on
    ViZDoom and on footage); at 0.7 every layer ran sparse by the end (77% / 64% of the layer-steps, kept
    fraction 0.24 / 0.35 instead of 0.61 / 0.51) at +0.14 +- 0.05% / +1.00 +- 0.91% validation loss against
    full attention, where 0.8 gave +0.34 +- 0.14% / +0.61 +- 0.11% (paired 0.7 - 0.8: -0.20 / +0.38%, within
    the seeds' spread on both)."""
    max_density: Optional[float] = _knob(
        0.25, "Cap on every head's budget density K_h / S (0 < cap <= 1; None: no cap, the paper's rule). With a cap "
        "a layer runs sparse from the first profiled stage-2 step whenever its capped budgets are sparse enough "
        "(1 - mean K_h / S >= sparsity_threshold) and faster, whatever its measured sparsity. Applies to either "
        "budget rule.")
    """Upper bound on the kept fraction of every head's list (a fixed top-k in the manner of VSA, per-head adaptive
    below it).

    The paper's rule waits for the measured sparsity: in the frontier's runs (1500 steps, 16K tokens) the layers
    crossed the 0.7 threshold only ~300-500 steps after a switch at step 400, so 38-45% of the stage-2 layer-steps ran
    dense. A cap keeps each head's budget at ``min(rule's K_h, max_density * S)`` (never under ``k_min`` or the
    neighbourhood of local + predicted lists), and the dispatcher decides on the capped budgets' effective
    sparsity instead of the measured one. Heads as sparse as the paper's (0.8-0.98) keep budgets under the cap:
    it binds on diffuse heads and early in stage 2.

    Default 0.25 (H200 frontier run 6, benchmarks/NOTES_quality.md: 16K tokens, 4 layers, 3 seeds, stage 2 from
    step 400): every stage-2 layer-step sparse at 23% of the keys, validation loss -0.12 +- 0.06% (ViZDoom) and
    -2.11 +- 1.23% (footage) against full attention at 1500 steps, full attention's final loss reached in 0.77x
    its time at 32K on both. Uncapped (run 5, the same switch): 62% / 55% of the layer-steps sparse and, charged
    by that share, ~0.82-0.88x / 0.87-0.91x. A 3D window at 29% of the keys did better than both there (-2.27 /
    -5.64%, 0.47x / 0.44x): see the notes. Over 3000 steps (run 7): -0.62 +- 0.12% on footage (4 seeds) and 0.72x
    of full attention's time to its loss at 32K; +0.35% on ViZDoom (one seed). None restores the uncapped rules."""
    k_min: int = _knob(64, "Smallest per-head KV budget in tokens.")
    """Floor of the per-head budget K_h (tokens)."""
    speedup_table: Optional[str] = _knob(
        None, "Path to a sparse_attention benchmark JSON giving the measured speedup per density and length "
        "(None: a FLOP model, optimistic at short lengths; there is no on-GPU calibration).")
    """Where the dispatcher reads the measured speedup of sparse over dense attention."""

    # ---- query groups and kernels -------------------------------------------
    query_group_shape: Tuple[int, int, int] = _knob(
        (4, 4, 8), "Query group cube (t, h, w) in latent tokens; its volume G must be one of 16, 32, 64, 128.")
    """3D cube of latent tokens that shares one KV list; G = t*h*w consecutive tokens.

    Default G = 128: on the H200 (S=64K, 90% sparse, benchmarks/results/sparse_attention-h200-*.json)
    the block-level forward at G=128 is 1.9x / 3.0x faster than at G=64 / 32 and the backward
    1.1x / 1.5x, and 4x4x8 is the most compact 128-token cube (neighbours share critical keys)."""
    local_radius: Optional[Tuple[int, int, int]] = _knob(
        None, "Local + predicted lists: every query cube always keeps the keys of the cubes within "
        "(rt, rh, rw) cubes of it, and the predictor's top-k fills the rest of its budget. None (auto): "
        "1 1 1 where the model gives a token grid the query cube tiles (the video DiT), with block lists "
        "and an estimator that takes it; off elsewhere (text, Wan's grids with partial cubes). 0 0 0: off.")
    """Always-on 3D neighbourhood of each query cube, in cubes per axis (DESIGN.md: the strongest peers
    pair their top-k branch with an always-on local one).

    The budget counts both parts: each head keeps at least the neighbourhood (every head's budget is
    floored at the largest neighbourhood), and the estimator ranks the neighbourhood's items above all
    others, so the top-k fills what is left. The profiler's recall curve ranks the same way, so the
    'recall' rule sizes the lists that run. Needs the token grid (the video DiT sets it on every
    forward) and a grid divisible by the cube; the CUDA estimator does not take it (Triton's does).

    Default None resolves per sequence (:meth:`local_radius_for`) to :data:`DEFAULT_LOCAL_RADIUS` where it
    applies: on the H200 quality frontier (ViZDoom 16K, 2 seeds, benchmarks/NOTES_quality.md run 2) the
    paper's rule with a (1, 1, 1) neighbourhood was -0.49 +- 0.38% against full attention at equal steps
    where the rule alone was +0.66 +- 0.28% (paired: -1.15 +- 0.10%)."""
    local_mode: str = _knob(
        "shared", "How local + predicted lists size each cube's list. 'shared': one budget per head for every cube, "
        "floored at the largest neighbourhood (edge cubes, with fewer neighbours, take more predicted items). "
        "'window': every cube keeps its own whole neighbourhood (the 3D window's keys) plus the head's predicted "
        "items, so list lengths differ by cube; the budget counts the mean neighbourhood.", choices=LOCAL_MODES)
    """Per-cube or shared list lengths for local + predicted lists (inert without a neighbourhood).

    'shared' (default): each head's budget ``K_h`` holds for every cube and is floored at the largest
    neighbourhood, so a neighbourhood as wide as the window's (2, 2, 1) at 16K (75 of 128 blocks) keeps every
    layer dense. 'window': cube g keeps its ``n_g`` neighbourhood blocks plus ``P_h = K_h - ceil(mean n_g)``
    predicted blocks (never below 0; ``K_h`` floored at the mean neighbourhood), i.e. the 3D window of the
    frontier's best arm (benchmarks/NOTES_quality.md runs 1, 2, 6) with the predictor's top-k on top. Under the
    'recall' rule ``K_h`` is read off the profiler's recall curve, which ranks the neighbourhood first for one
    length shared by every cube: an approximation of the per-cube lists (their measured recall is logged exactly).
    Runs under context parallelism (the per-cube lengths travel with their lists). Measured on the frontier (run 8,
    ViZDoom, 2 seeds, ``windowpred35_s400``): +0.12 +- 0.30% against full attention at 3000 steps, more keys than
    'shared' for no gain: off."""
    granularity: str = _knob("block", "KV list granularity: 'token' (the paper) or 'block' (contiguous KV blocks).",
                             choices=GRANULARITIES)
    """Whether KV lists name single key tokens or contiguous key blocks."""
    kv_block_size: int = _knob(128, "KV block size in tokens for granularity 'block' (64 or 128).")
    """Tokens per KV block at block granularity (128: within 4% of 64 in our kernels, and the
    only size FlexAttention, the fallback peer, compiles for on torch 2.11)."""
    group_proxy: str = _knob("mean", "Query-group proxy for estimation: 'mean' of the group's q_lr or 'middle' token.",
                             choices=GROUP_PROXIES)
    """How one low-rank query stands for its group during estimation."""
    block_score: str = _knob("max", "Score of a KV block from its tokens' low-rank scores: 'max' or 'lse'.",
                             choices=BLOCK_SCORES)
    """How a KV block's estimated score is formed from its tokens' scores."""
    kernel_backend: str = _knob("auto", "Sparse attention backend: auto, triton, flex, naive.", choices=KERNEL_BACKENDS)
    """Sparse attention kernel backend (auto: fastest measured on this device)."""
    topk_backend: str = _knob("auto", "Top-k estimation backend: auto, cuda, triton, naive.", choices=TOPK_BACKENDS)
    """Estimation backend (auto: compiled CUDA op if loaded, else Triton, else naive)."""

    # ---- context parallelism ------------------------------------------------
    cp_mode: str = _knob("none", "Context-parallel mode of DSV attention: none, head, seq, hybrid.", choices=CP_MODES)
    """How DSV attention splits work over the CP group."""

    def __post_init__(self):
        self.query_group_shape = tuple(int(x) for x in self.query_group_shape)
        if isinstance(self.local_radius, (list, tuple)):
            self.local_radius = tuple(self.local_radius)
        if isinstance(self.stage1_local_radius, list):
            self.stage1_local_radius = tuple(self.stage1_local_radius)
        self._check_choices()
        self._check_ranges()

    # ------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """G: tokens per query group (the cube volume)."""
        return math.prod(self.query_group_shape)

    @property
    def uses_local(self) -> bool:
        """True when local + predicted lists are asked for explicitly (``local_radius`` set, not all zero)."""
        return self.local_radius is not None and any(self.local_radius)

    def _tiles(self, token_grid: Optional[Sequence[int]]) -> bool:
        """True when ``token_grid`` is a known (T, H, W) grid that whole query cubes tile."""
        return (token_grid is not None and len(token_grid) == 3
                and not any(int(g) % c for g, c in zip(token_grid, self.query_group_shape)))

    def stage1_radius_for(self, token_grid: Optional[Sequence[int]]) -> Optional[Tuple[int, int, int]]:
        """The window stage 1 attends on a sequence of ``token_grid`` (None: dense attention).

        An explicit ``stage1_local_radius`` holds as given ((0, 0, 0): dense; a radius without a grid is refused
        where the lists are built). The default None gives :data:`DEFAULT_STAGE1_LOCAL_RADIUS` when the grid is
        known and tiled by ``query_group_shape``, lists are key blocks, and the window's block lists keep at
        most ``1 - sparsity_threshold`` of the keys."""
        if self.stage1_local_radius is not None:
            return self.stage1_local_radius if any(self.stage1_local_radius) else None
        if self.block_size == 0 or not self._tiles(token_grid):
            return None
        from megatron_dsv.attention.neighbourhood import local_items_with_counts  # torch-only, imported on use

        # the keys the window's block lists hold (a cube smaller than a key block keeps whole blocks)
        mean_items = local_items_with_counts(token_grid, self.query_group_shape, DEFAULT_STAGE1_LOCAL_RADIUS,
                                             self.block_size, "cpu")[2]
        kept = mean_items * self.block_size / math.prod(token_grid)
        return DEFAULT_STAGE1_LOCAL_RADIUS if kept <= 1.0 - self.sparsity_threshold + 1e-9 else None

    def local_radius_for(self, token_grid: Optional[Sequence[int]],
                         topk_backend: Optional[str] = None) -> Optional[Tuple[int, int, int]]:
        """The neighbourhood radius in effect on a sequence of ``token_grid`` (None: no local part).

        An explicit ``local_radius`` holds as given ((0, 0, 0): off; a radius without a grid is refused
        where the lists are built). The default None gives :data:`DEFAULT_LOCAL_RADIUS` when the grid is
        known and tiled by ``query_group_shape``, lists are blocks and the top-k backend is not 'cuda'
        (``topk_backend``: the one the layer resolved, e.g. from ``DSV_TOPK_BACKEND``; default the field's)."""
        if self.local_radius is not None:
            return self.local_radius if any(self.local_radius) else None
        backend = self.topk_backend if topk_backend is None else topk_backend
        if self.block_size == 0 or backend == "cuda" or not self._tiles(token_grid):
            return None
        return DEFAULT_LOCAL_RADIUS

    @property
    def block_size(self) -> int:
        """KV block size handed to the ops: 0 at token granularity."""
        return self.kv_block_size if self.granularity == "block" else 0

    def _check_choices(self):
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(f"DSVConfig.{f.name} must be one of {list(choices)}, got {getattr(self, f.name)!r}")

    def _check_ranges(self):
        def need(ok: bool, name: str, allowed: str):
            if not ok:
                raise ValueError(f"DSVConfig.{name} must be {allowed}, got {getattr(self, name)!r}")

        need(self.predictor_rank in (8, 16, 32), "predictor_rank", "one of 8, 16, 32")
        need(self.predictor_loss_cos_weight >= 0, "predictor_loss_cos_weight", ">= 0")
        need(self.predictor_loss_mse_weight >= 0, "predictor_loss_mse_weight", ">= 0")
        need(self.predictor_loss_cos_weight + self.predictor_loss_mse_weight > 0, "predictor_loss_cos_weight",
             "> 0 together with predictor_loss_mse_weight")
        need(self.predictor_query_stride >= 1, "predictor_query_stride", ">= 1")
        need(self.predictor_lr > 0, "predictor_lr", "> 0")
        need(0 <= self.predictor_lr_stage2_scale <= 1, "predictor_lr_stage2_scale", "in [0, 1]")
        need(0 < self.theta < 1, "theta", "in (0, 1)")
        need(self.profile_interval >= 1, "profile_interval", ">= 1")
        need(self.profile_interval_after_warmup >= 1, "profile_interval_after_warmup", ">= 1")
        need(self.profile_warmup_steps >= 0, "profile_warmup_steps", ">= 0")
        need(isinstance(self.profile_max_queries, int) and self.profile_max_queries >= 0, "profile_max_queries",
             "an int >= 0 (0: no cap)")
        need(0 <= self.sparsity_momentum < 1, "sparsity_momentum", "in [0, 1)")
        need(isinstance(self.predictor_train_interval, int) and not isinstance(self.predictor_train_interval, bool)
             and self.predictor_train_interval >= 0, "predictor_train_interval", "an int >= 0")
        need(isinstance(self.recall_target, (int, float)) and 0 < self.recall_target <= 1, "recall_target",
             "in (0, 1]")
        need(self.stage_switch_loss >= 0, "stage_switch_loss", ">= 0")
        need(self.stage_switch_steps is None or self.stage_switch_steps >= 0, "stage_switch_steps", "None or >= 0")
        if self.stage_switch_rule in ("steps", "loss_and_steps"):
            need(self.stage_switch_steps is not None, "stage_switch_steps",
                 f"set (an int >= 0) when stage_switch_rule is {self.stage_switch_rule!r}")
        need(0 <= self.sparsity_threshold <= 1, "sparsity_threshold", "in [0, 1]")
        need(self.k_min >= 1, "k_min", ">= 1")
        need(self.max_density is None or isinstance(self.max_density, (int, float))
             and not isinstance(self.max_density, bool) and 0 < self.max_density <= 1, "max_density",
             "None (no cap) or in (0, 1]")
        need(len(self.query_group_shape) == 3 and all(x >= 1 for x in self.query_group_shape),
             "query_group_shape", "three positive ints (t, h, w)")
        need(self.group_size in SUPPORTED_GROUP_SIZES, "query_group_shape",
             f"a cube whose volume is one of {list(SUPPORTED_GROUP_SIZES)}")
        need(self.local_radius is None or isinstance(self.local_radius, tuple) and len(self.local_radius) == 3
             and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in self.local_radius),
             "local_radius", "None (auto) or three ints >= 0 (rt, rh, rw), in cubes")
        need(not (self.uses_local and self.topk_backend == "cuda"), "topk_backend",
             "'auto', 'triton' or 'naive' with local_radius (the CUDA estimator takes no local part)")
        need(self.kv_block_size in SUPPORTED_KV_BLOCKS, "kv_block_size", f"one of {list(SUPPORTED_KV_BLOCKS)}")
        need(self.stage1_local_radius is None or isinstance(self.stage1_local_radius, tuple)
             and len(self.stage1_local_radius) == 3
             and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in self.stage1_local_radius),
             "stage1_local_radius", "None (auto) or three ints >= 0 (rt, rh, rw), in cubes (0 0 0: a dense stage 1)")

    def to_dict(self) -> dict:
        """Plain dict (for logs and checkpoints)."""
        return dataclasses.asdict(self)
