"""``python -m megatron_dsv.train --pretrained DIR``: a tiny random diffusers Wan2.1 model, converted
(tools/convert_checkpoint.py's functions), fine-tuned in-process with DSV on latent shards carrying text
embeddings: the trainer loads the converted weights before the first step, losses are finite, a resumed
run reproduces the uninterrupted one exactly, and the flag's misuses fail with one line naming it."""

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed: pip install -e .[wan] (or .[test])")
pytest.importorskip("safetensors", reason="safetensors is not installed: pip install -e .[wan]")

from megatron_dsv.data import write_shard  # noqa: E402
from megatron_dsv.training.arguments import parse_args  # noqa: E402

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
            text_dim=24, freq_dim=32, ffn_dim=128, num_layers=2, rope_max_seq_len=64)
LATENT = (2, 16, 16)  # -> 2 x 8 x 8 = 128 tokens
TEXT_LEN = 5


@pytest.fixture(scope="module")
def converted(megatron_cpu, tmp_path_factory):
    """(converted checkpoint folder, shard folder, the converted model's state dict)."""
    from megatron_dsv.models.wan_convert import convert_diffusers_folder

    root = tmp_path_factory.mktemp("pretrained_wan")
    torch.manual_seed(0)
    ref = diffusers.WanTransformer3DModel(**TINY)
    with torch.no_grad():  # off the init (zero biases, unit norms)
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(str(root / "diffusers"), safe_serialization=True)
    cfg, model = convert_diffusers_folder(str(root / "diffusers"), str(root / "megatron"), latent_grid=LATENT)
    (root / "shards").mkdir()
    (root / "no_text").mkdir()
    g = torch.Generator().manual_seed(3)
    for k in range(2):
        n = 4
        mask = torch.ones(n, TEXT_LEN, dtype=torch.bool)
        mask[:, -2:] = torch.rand(n, 2, generator=g) < 0.5
        latents = torch.randn(n, TINY["in_channels"], *LATENT, generator=g)
        text = torch.randn(n, TEXT_LEN, TINY["text_dim"], generator=g)
        write_shard(str(root / "shards" / f"s{k}.safetensors"), latents, text=text, text_mask=mask)
    write_shard(str(root / "no_text" / "s0.safetensors"), torch.randn(2, TINY["in_channels"], *LATENT, generator=g))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    return str(root / "megatron"), str(root / "shards"), weights, root


def _flags(converted, tmp_path, name, *extra):
    ckpt, shards, _, _ = converted
    return ["--use-dsv-attention", "--pretrained", ckpt, "--data-path", shards, "--micro-batch-size", "2",
            "--log-interval", "1", "--lr", "1e-4", "--eval-iters", "0", "--dsv-k-min", "8",
            "--dsv-profile-interval", "2", "--dsv-stage-switch-steps", "2", "--output-dir", str(tmp_path / name),
            *extra]


def _train(converted, tmp_path, name, *extra):
    from megatron_dsv.training.trainer import train

    return train(parse_args(_flags(converted, tmp_path, name, *extra)))


def test_trainer_loads_the_converted_weights(converted, tmp_path):
    from megatron_dsv.attention import dsv_stage
    from megatron_dsv.training.distributed import initialize_distributed
    from megatron_dsv.training.trainer import build_model

    args = parse_args(_flags(converted, tmp_path, "build"))
    model, cfg, dsv = build_model(args, initialize_distributed(args))
    assert dsv is not None and dsv_stage(model) == 1 and tuple(cfg.latent_grid) == LATENT
    state, weights = model.state_dict(), converted[2]
    for key in ("patch_embed.weight", "decoder.layers.1.self_attention.linear_qkv.weight", "proj_out.bias"):
        assert torch.equal(state[key], weights[key]), key


def test_finetune_with_dsv_and_exact_resume(converted, tmp_path, capsys):
    full = _train(converted, tmp_path, "full", "--train-iters", "4", "--no-save")
    assert len(full.losses) == 4 and all(torch.isfinite(torch.tensor(full.losses)))
    assert full.dsv_stages[0] == 1 and full.dsv_stages[-1] == 2
    assert "no sample GIF" in capsys.readouterr().out
    ckpt = str(tmp_path / "ckpt")
    first = _train(converted, tmp_path, "first", "--train-iters", "4", "--save", ckpt, "--exit-interval", "2")
    second = _train(converted, tmp_path, "second", "--train-iters", "4", "--save", ckpt, "--load", ckpt)
    assert second.start_iteration == 2 and first.losses + second.losses == full.losses  # exact
    # a --pretrained run's checkpoint does not resume as a VideoDiT
    with pytest.raises(ValueError, match="resume it with --pretrained"):
        from megatron_dsv.training.trainer import train

        train(parse_args(["--load", ckpt, "--no-sample", "--output-dir", str(tmp_path / "bad"), "--train-iters", "5"]))


def test_bad_pretrained_flags_name_the_flag(converted, tmp_path, capsys):
    ckpt, shards, _, root = converted
    cases = [(["--pretrained", str(root / "diffusers"), "--data-path", shards], "--pretrained must be a converted"),
             (["--pretrained", str(tmp_path / "missing"), "--data-path", shards], "--pretrained must be a converted"),
             (["--pretrained", ckpt], "--data-path"),
             (["--pretrained", ckpt, "--data-path", shards, "--num-layers", "3"], "drop --num-layers")]
    for flags, message in cases:
        with pytest.raises(SystemExit):
            parse_args(flags)
        err = capsys.readouterr().err
        assert message in err and "--pretrained" in err and err.count("\n") == 1, err
    with pytest.raises(ValueError, match="needs text embeddings"):
        _train(converted, tmp_path, "no_text", "--train-iters", "1", "--data-path", str(root / "no_text"))
