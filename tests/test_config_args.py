"""DSVConfig validation and the --dsv-* flags round trip."""

import argparse
import dataclasses

import pytest

from megatron_dsv.arguments import add_dsv_args, dsv_config_from_args, flag_name
from megatron_dsv.config import DSVConfig


def _parse(argv):
    return add_dsv_args(argparse.ArgumentParser()).parse_args(argv)


def test_defaults_match_design():
    c = DSVConfig()
    assert (c.predictor_rank, c.theta, c.sparsity_momentum, c.sparsity_threshold) == (16, 0.9, 0.9, 0.7)
    assert (c.predictor_loss_cos_weight, c.predictor_loss_mse_weight) == (0.9, 0.1)
    assert (c.profile_interval, c.profile_interval_after_warmup, c.predictor_query_stride) == (25, 100, 64)
    assert c.stage_switch_loss == 0.01 and c.group_size == 128 and c.block_size == 128


def test_flags_off_gives_no_config():
    assert dsv_config_from_args(_parse([])) is None


def test_every_field_has_a_flag_and_help():
    parser = add_dsv_args(argparse.ArgumentParser())
    text = parser.format_help()
    for f in dataclasses.fields(DSVConfig):
        assert flag_name(f.name) in text, f.name
        assert f.metadata.get("help"), f"{f.name} has no help text"


def test_args_round_trip():
    argv = ["--use-dsv-attention", "--dsv-predictor-rank", "32", "--dsv-predictor-input", "hidden",
            "--dsv-theta", "0.95", "--dsv-query-group-shape", "4", "4", "4", "--dsv-granularity", "token",
            "--dsv-kv-block-size", "64", "--dsv-stage-switch-rule", "steps", "--dsv-stage-switch-steps", "500",
            "--dsv-k-min", "128", "--dsv-cp-mode", "head", "--dsv-speedup-table", "x.json",
            "--dsv-kernel-backend", "flex", "--dsv-topk-backend", "naive", "--dsv-block-score", "lse"]
    c = dsv_config_from_args(_parse(argv))
    assert c.predictor_rank == 32 and c.predictor_input == "hidden" and c.theta == 0.95
    assert c.query_group_shape == (4, 4, 4) and c.group_size == 64
    assert c.granularity == "token" and c.block_size == 0 and c.kv_block_size == 64
    assert c.stage_switch_rule == "steps" and c.stage_switch_steps == 500 and c.k_min == 128
    assert (c.cp_mode, c.speedup_table, c.kernel_backend, c.topk_backend, c.block_score) == \
        ("head", "x.json", "flex", "naive", "lse")
    # Every other field keeps its default.
    default = DSVConfig()
    assert c.predictor_lr == default.predictor_lr and c.profile_warmup_steps == default.profile_warmup_steps


def test_optional_none_flag():
    c = dsv_config_from_args(_parse(["--use-dsv-attention", "--dsv-stage-switch-rule", "loss",
                                     "--dsv-stage-switch-steps", "none"]))
    assert c.stage_switch_steps is None and c.stage_switch_rule == "loss"
    c = dsv_config_from_args(_parse(["--use-dsv-attention"]))  # the default: stage 2 by steps, where measured
    assert (c.stage_switch_rule, c.stage_switch_steps) == ("steps", 400)


def test_local_radius_flag_takes_three_ints_or_auto():
    def radius(*argv):
        return dsv_config_from_args(_parse(["--use-dsv-attention", *argv])).local_radius

    assert radius() is None and radius("--dsv-local-radius", "auto") is None
    assert radius("--dsv-local-radius", "0", "1", "2") == (0, 1, 2)
    for bad in (["1", "2"], ["a", "b", "c"], ["1", "2", "3", "4"], ["none"]):
        with pytest.raises(SystemExit):
            _parse(["--use-dsv-attention", "--dsv-local-radius", *bad])


def test_bad_choice_flag_is_rejected():
    with pytest.raises(SystemExit):
        _parse(["--use-dsv-attention", "--dsv-granularity", "row"])


def test_missing_provider_is_reported():
    ns = argparse.Namespace(use_dsv_attention=True)
    with pytest.raises(ValueError, match="add_dsv_args"):
        dsv_config_from_args(ns)


@pytest.mark.parametrize("kwargs, field", [
    (dict(predictor_rank=12), "predictor_rank"),
    (dict(predictor_input="x"), "predictor_input"),
    (dict(predictor_loss_cos_weight=-1), "predictor_loss_cos_weight"),
    (dict(predictor_loss_mse_weight=-0.1), "predictor_loss_mse_weight"),
    (dict(predictor_loss_cos_weight=0, predictor_loss_mse_weight=0), "predictor_loss_cos_weight"),
    (dict(predictor_query_stride=0), "predictor_query_stride"),
    (dict(predictor_lr=0), "predictor_lr"),
    (dict(predictor_lr_stage2_scale=2), "predictor_lr_stage2_scale"),
    (dict(theta=1.0), "theta"),
    (dict(theta=0.0), "theta"),
    (dict(profile_interval=0), "profile_interval"),
    (dict(profile_interval_after_warmup=0), "profile_interval_after_warmup"),
    (dict(profile_warmup_steps=-1), "profile_warmup_steps"),
    (dict(sparsity_momentum=1.0), "sparsity_momentum"),
    (dict(stage_switch_rule="never"), "stage_switch_rule"),
    (dict(stage_switch_loss=-1), "stage_switch_loss"),
    (dict(stage_switch_steps=-5), "stage_switch_steps"),
    (dict(stage_switch_rule="steps", stage_switch_steps=None), "stage_switch_steps"),
    (dict(stage_switch_rule="loss_and_steps", stage_switch_steps=None), "stage_switch_steps"),
    (dict(sparsity_threshold=1.5), "sparsity_threshold"),
    (dict(k_min=0), "k_min"),
    (dict(query_group_shape=(2, 4)), "query_group_shape"),
    (dict(query_group_shape=(3, 3, 3)), "query_group_shape"),
    (dict(query_group_shape=(0, 4, 4)), "query_group_shape"),
    (dict(granularity="row"), "granularity"),
    (dict(kv_block_size=32), "kv_block_size"),
    (dict(group_proxy="first"), "group_proxy"),
    (dict(block_score="mean"), "block_score"),
    (dict(kernel_backend="cuda"), "kernel_backend"),
    (dict(topk_backend="flex"), "topk_backend"),
    (dict(cp_mode="ring"), "cp_mode"),
])
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"DSVConfig\.{field}"):
        DSVConfig(**kwargs)


def test_config_errors_from_flags_name_the_flag():
    with pytest.raises(ValueError, match=r"^--dsv-theta must be in \(0, 1\), got 1\.5$"):
        dsv_config_from_args(_parse(["--use-dsv-attention", "--dsv-theta", "1.5"]))
    with pytest.raises(ValueError, match=r"^--dsv-predictor-loss-cos-weight must be > 0 together with "
                                         r"--dsv-predictor-loss-mse-weight"):
        dsv_config_from_args(_parse(["--use-dsv-attention", "--dsv-predictor-loss-cos-weight", "0",
                                     "--dsv-predictor-loss-mse-weight", "0"]))
