"""Helpers for the DSV-method tests: a standalone DSVCoreAttention and planted sparse inputs."""

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dsv.attention.core_attention import DSVCoreAttention
from megatron_dsv.config import DSVConfig


def tf_config(hidden=128, heads=2, kv_heads=None, layers=1, **kw):
    base = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=kv_heads,
                use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
                bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False)
    base.update(kw)
    return TransformerConfig(**base)


def dsv_config(**kw):
    base = dict(query_group_shape=(1, 4, 4), granularity="token", k_min=16, kernel_backend="naive",
                topk_backend="naive", predictor_query_stride=8, profile_interval=1, stage_switch_rule="loss")
    base.update(kw)
    return DSVConfig(**base)


def force_state(layer, stage=None, sparsity=None, density=None):
    """Set a layer's checkpointed state directly (as a loaded checkpoint would). ``density`` (the
    'recall' rule's budget density) defaults to ``1 - sparsity``: both rules then give the same budgets."""
    if stage is not None:
        layer.stage.fill_(stage)
    if sparsity is not None:
        layer.sparsity.copy_(torch.as_tensor(sparsity, dtype=torch.float32).expand_as(layer.sparsity))
        layer.profiles.fill_(max(1, int(layer.profiles[0])))
        if density is None:
            layer.budget_density.copy_(1.0 - layer.sparsity)
    if density is not None:
        layer.budget_density.copy_(torch.as_tensor(density, dtype=torch.float32).expand_as(layer.budget_density))
        layer.profiles.fill_(max(1, int(layer.profiles[0])))
    layer._sync_host()


def planted(S=512, H=2, D=64, B=1, clusters=8, nuisance=4.0, seed=0, centers_seed=123):
    """q, k ``[B, H, S, D]`` with a planted sparse structure.

    Each key belongs to a random cluster (critical keys are not local); each query group of
    16 tokens shares a cluster, so its critical keys are that cluster's (~1/clusters of all keys).
    Half of q's dimensions carry large noise that k does not have: it leaves q k^T alone
    but spoils a random projection, so the predictor has to learn to ignore it.
    """
    gc = torch.Generator().manual_seed(centers_seed)
    centers = torch.randn(H, clusters, D // 2, generator=gc) * 2.0
    g = torch.Generator().manual_seed(seed)
    kc = torch.randint(0, clusters, (B, H, S), generator=g)
    qc = torch.randint(0, clusters, (B, H, S // 16), generator=g).repeat_interleave(16, -1)
    pick = lambda c: torch.gather(centers.unsqueeze(0).expand(B, -1, -1, -1), 2,  # noqa: E731
                                  c.unsqueeze(-1).expand(-1, -1, -1, D // 2))
    k = torch.cat([pick(kc) + 0.3 * torch.randn(B, H, S, D // 2, generator=g), torch.zeros(B, H, S, D // 2)], -1)
    q = torch.cat([pick(qc) + 0.3 * torch.randn(B, H, S, D // 2, generator=g),
                   nuisance * torch.randn(B, H, S, D // 2, generator=g)], -1)
    return q, k


def as_megatron(t):
    """[B, H, S, D] -> Megatron's [S, B, H, D]."""
    return t.permute(2, 0, 1, 3).contiguous()


@pytest.fixture
def make_layer(megatron_cpu):
    def make(cfg=None, tf=None, layer_number=1, **kw):
        cfg = cfg if cfg is not None else dsv_config(**kw)
        tf = tf if tf is not None else tf_config()
        return DSVCoreAttention(tf, layer_number, AttnMaskType.no_mask, "self", pg_collection=megatron_cpu,
                                dsv_config=cfg)

    return make

