"""A Megatron-Core TransformerBlock with DSV core attention (local spec, gloo world size 1, CPU):
stage 1 then stage 2, forward + backward, both predictor inputs."""

import pytest
import torch

from megatron_dsv.attention import dsv_layers, dsv_metrics, dsv_on_step_end, dsv_stage
from megatron_dsv.models.specs import DSVSelfAttention, get_dsv_layer_spec

from .conftest import dsv_config, tf_config


def _block(cfg, layers=2):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    torch.manual_seed(0)
    spec = get_dsv_layer_spec(get_gpt_layer_local_spec(), cfg)
    return TransformerBlock(tf_config(hidden=128, heads=2, layers=layers), spec)


@pytest.mark.parametrize("predictor_input", ["qk", "hidden"])
def test_block_stage1_then_stage2(megatron_cpu, fast_table, predictor_input):
    cfg = dsv_config(predictor_input=predictor_input, stage_switch_rule="steps", stage_switch_steps=2,
                     sparsity_threshold=0.0, speedup_table=fast_table, granularity="block", kv_block_size=64)
    block = _block(cfg)
    layers = dsv_layers(block)
    assert len(layers) == 2 and all(l.predictor.mode == predictor_input for l in layers)
    assert isinstance(block.layers[0].self_attention, DSVSelfAttention) == (predictor_input == "hidden")
    opt = torch.optim.SGD(block.parameters(), lr=1e-3)
    S, B = 256, 2
    for it in range(4):
        x = torch.randn(S, B, 128, requires_grad=True)
        out = block(hidden_states=x, attention_mask=None)
        out.square().mean().backward()
        assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
        for name, p in block.named_parameters():
            if p.requires_grad:
                assert p.grad is not None and torch.isfinite(p.grad).all(), name
        expect_sparse = dsv_stage(block) == 2
        assert all(l.last_sparse == expect_sparse for l in layers)
        opt.step()
        opt.zero_grad()
        dsv_on_step_end(block, it + 1)
    assert dsv_stage(block) == 2 and expect_sparse
    m = dsv_metrics(block)
    assert m["dsv/stage"] == 2.0 and m["dsv/sparse_fraction"] == 1.0
    for n in (1, 2):
        assert 0.0 <= m[f"dsv/layer{n}/recall"] <= 1.0 and m[f"dsv/layer{n}/predictor_loss"] > 0
    # the predictors learned outside the main optimizer, and are not among its parameters
    assert all(not p.requires_grad for l in layers for p in l.predictor.parameters())
    assert all(float(l.predictor.adam_steps[0]) == 4 for l in layers)


def test_hidden_input_rejects_selective_core_attn_recompute(megatron_cpu):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    tf = tf_config(recompute_granularity="selective", recompute_modules=["core_attn"])
    spec = get_dsv_layer_spec(get_gpt_layer_local_spec(), dsv_config(predictor_input="hidden"))
    with pytest.raises(ValueError, match="core_attn"):
        TransformerBlock(tf, spec)
