"""DSVCoreAttention inside real Megatron-Core modules (gloo, world size 1, CPU).

The DSV model must match the same model built with a reference core attention
(plain fp32 softmax attention written out below, Megatron's mask convention) in
outputs and gradients, for TransformerBlock and GPTModel. Megatron's own
DotProductAttention cannot run on a CPU-only torch (it forks the CUDA RNG
tracker), so the reference is written here.
"""

import copy
import math

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dsv.attention.core_attention import DSVCoreAttention
from megatron_dsv.config import DSVConfig
from megatron_dsv.models.specs import get_dsv_layer_spec, get_gpt_dsv_layer_spec


def _config(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                attention_dropout=0.0, hidden_dropout=0.0, bias_dropout_fusion=False,
                masked_softmax_fusion=False, gradient_accumulation_fusion=False)
    base.update(kw)
    return TransformerConfig(**base)


class ReferenceCoreAttention(MegatronModule):
    """softmax(q k^T * scale + mask) v in fp32, with GQA by repetition; Megatron's core_attention contract."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        rep = query.shape[2] // key.shape[2]
        key, value = key.repeat_interleave(rep, 2), value.repeat_interleave(rep, 2)
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) * self.scale
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, float("-inf"))
        out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), value)
        return out.reshape(out.shape[0], out.shape[1], -1)


def _stock_spec(mask_type=AttnMaskType.no_mask):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec())
    spec.submodules.self_attention.params = {"attn_mask_type": mask_type}
    return spec


def _reference_spec(mask_type=AttnMaskType.no_mask):
    spec = _stock_spec(mask_type)
    spec.submodules.self_attention.submodules.core_attention = ReferenceCoreAttention
    return spec


def _block(spec, cfg, seed=0):
    from megatron.core.transformer.transformer_block import TransformerBlock

    torch.manual_seed(seed)
    return TransformerBlock(cfg, spec)


def _copy_weights(src, dst):
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    assert not unexpected
    assert all("core_attention" in k for k in missing), missing  # only DSV's own state is new


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and "core_attention" not in n}


@pytest.mark.parametrize("num_query_groups", [None, 2], ids=["MHA", "GQA2"])
def test_transformer_block_matches_stock(megatron_cpu, num_query_groups):
    cfg = _config(num_query_groups=num_query_groups)
    stock = _block(_reference_spec(), cfg)
    dsv = _block(get_dsv_layer_spec(_stock_spec(), DSVConfig()), cfg, seed=1)
    _copy_weights(stock, dsv)
    assert isinstance(dsv.layers[0].self_attention.core_attention, DSVCoreAttention)
    x = torch.randn(37, 3, 64)
    outs = []
    for model in (stock, dsv):
        xi = x.clone().requires_grad_(True)
        out = model(xi, attention_mask=None)
        out.pow(2).mean().backward()
        outs.append((out.detach(), xi.grad.clone(), _grads(model)))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)
    assert outs[0][2].keys() == outs[1][2].keys() and len(outs[0][2]) > 0
    for name in outs[0][2]:
        torch.testing.assert_close(outs[1][2][name], outs[0][2][name], rtol=1e-4, atol=1e-5, msg=name)


def test_padding_mask_matches_stock(megatron_cpu):
    cfg = _config()
    stock = _block(_reference_spec(AttnMaskType.padding), cfg)
    dsv = _block(get_dsv_layer_spec(_stock_spec(), DSVConfig(), attn_mask_type=AttnMaskType.padding), cfg)
    _copy_weights(stock, dsv)
    b, s = 2, 21
    mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    mask[0, ..., 15:] = True  # sample 0: last 6 keys are padding (True = masked out, Megatron's convention)
    x = torch.randn(s, b, 64)
    ref = stock(x, attention_mask=mask)
    out = dsv(x, attention_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_gpt_model_with_dsv_spec(megatron_cpu):
    from megatron.core.models.gpt import GPTModel

    cfg = _config()

    def build(spec, seed):
        torch.manual_seed(seed)
        return GPTModel(cfg, spec, vocab_size=96, max_sequence_length=64, position_embedding_type="learned_absolute")  # megatron RoPE needs CUDA

    stock = build(_reference_spec(), 0)
    dsv = build(get_gpt_dsv_layer_spec(DSVConfig(), use_te=False), 1)
    _copy_weights(stock, dsv)
    ids = torch.randint(0, 96, (2, 29))
    pos = torch.arange(29).expand(2, 29)
    ref = stock(ids, pos, attention_mask=None)
    out = dsv(ids, pos, attention_mask=None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for n, p in dsv.named_parameters() if "core_attention" not in n)


def test_stock_spec_untouched_when_dsv_off():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    base = get_gpt_layer_local_spec()
    snapshot = copy.deepcopy(base)
    swapped = get_dsv_layer_spec(base, DSVConfig())
    assert base.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert base.submodules.self_attention.params == snapshot.submodules.self_attention.params
    assert swapped.submodules.self_attention.submodules.core_attention.module is DSVCoreAttention
    off = get_gpt_dsv_layer_spec(None, use_te=False)
    assert off.submodules.self_attention.submodules.core_attention is DotProductAttention


def test_softmax_scale_is_used(megatron_cpu):
    cfg = _config(num_layers=1)
    attn = DSVCoreAttention(cfg, 1, AttnMaskType.no_mask, "self", softmax_scale=0.05, pg_collection=megatron_cpu)
    q, k, v = (torch.randn(11, 2, 4, 16) for _ in range(3))
    out = attn(q, k, v, None)
    probs = torch.softmax(torch.einsum("sbhd,tbhd->bhst", q, k) * 0.05, dim=-1)
    ref = torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(11, 2, 64)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    default = DSVCoreAttention(cfg, 1, AttnMaskType.no_mask, "self", pg_collection=megatron_cpu)
    assert math.isclose(default.softmax_scale, 1 / 4.0)


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.arbitrary])
def test_unsupported_mask_types(megatron_cpu, mask_type):
    with pytest.raises(ValueError, match="attn_mask_type"):
        DSVCoreAttention(_config(), 1, mask_type, "self", pg_collection=megatron_cpu)
    with pytest.raises(ValueError, match="attn_mask_type"):
        get_dsv_layer_spec(_stock_spec(), DSVConfig(), attn_mask_type=mask_type)


def test_bad_inputs_are_named(megatron_cpu):
    cfg = _config()
    attn = DSVCoreAttention(cfg, 1, AttnMaskType.no_mask, "self", pg_collection=megatron_cpu)
    q = torch.randn(8, 2, 4, 16)
    with pytest.raises(ValueError, match="query must be"):
        attn(torch.randn(8, 2, 3, 16), q, q, None)
    with pytest.raises(ValueError, match="key/value heads"):
        attn(q, torch.randn(8, 2, 3, 16), torch.randn(8, 2, 3, 16), None)
    with pytest.raises(ValueError, match="packed_seq_params"):
        attn(q, q, q, None, packed_seq_params=object())
    with pytest.raises(ValueError, match="attention_bias"):
        attn(q, q, q, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="attention_mask must be a bool"):
        attn(q, q, q, torch.zeros(2, 1, 1, 8), attn_mask_type=AttnMaskType.padding)
    with pytest.raises(ValueError, match="attention_dropout"):
        DSVCoreAttention(_config(attention_dropout=0.1), 1, AttnMaskType.no_mask, "self", pg_collection=megatron_cpu)
    with pytest.raises(ValueError, match="dsv_config"):
        DSVCoreAttention(cfg, 1, AttnMaskType.no_mask, "self", pg_collection=megatron_cpu, dsv_config={"theta": 0.9})
    with pytest.raises(ValueError, match="base_spec"):
        get_dsv_layer_spec(object(), DSVConfig())
