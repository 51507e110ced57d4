"""--ema-decay: the fp32 EMA of the trainable weights (ModelEMA), validation on it, and its checkpoints."""

import json

import pytest
import torch

from megatron_dsv.training.ema import ModelEMA
from tests.training.helpers import run


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)  # as DSV's predictor weights
        self.register_buffer("stat", torch.zeros(2))


def test_update_follows_the_warmed_up_decay_and_skips_frozen_weights():
    net = _Net()
    ema = ModelEMA(net, decay=0.5)
    assert ema.names == ["lin.weight", "lin.bias"]
    start = net.lin.weight.detach().clone()
    with torch.no_grad():
        net.lin.weight.add_(1.0)
    assert ema.current_decay() == pytest.approx(0.1)  # min(0.5, (1 + 0) / (10 + 0))
    ema.update(net)
    assert torch.allclose(ema.shadow["lin.weight"], 0.1 * start + 0.9 * (start + 1))
    ema.num_updates = 100
    assert ema.current_decay() == 0.5
    assert ModelEMA(net, decay=0.5, warmup=False).current_decay() == 0.5
    with pytest.raises(ValueError, match="decay must be in"):
        ModelEMA(net, decay=1.0)


def test_swap_in_holds_the_average_and_restores_the_live_weights_exactly():
    net = _Net().to(torch.float64)  # another dtype than the fp32 average
    ema = ModelEMA(net, decay=0.9)
    with torch.no_grad():
        net.lin.weight.mul_(3.0).add_(1e-9)
    live = {k: v.clone() for k, v in net.state_dict().items()}
    ema.update(net)
    with ema.swap_in(net) as swapped:
        assert swapped is net
        assert torch.equal(net.lin.weight, ema.shadow["lin.weight"].to(torch.float64))
        assert torch.equal(net.frozen, live["frozen"])  # not averaged: the live value
    for key, value in net.state_dict().items():
        assert torch.equal(value, live[key]), key


def test_state_dict_round_trip_and_mismatch():
    net = _Net()
    ema = ModelEMA(net, decay=0.99)
    with torch.no_grad():
        net.lin.bias.add_(2.0)
    ema.update(net)
    other = ModelEMA(_Net(), decay=0.99)
    other.load_state_dict(ema.state_dict())
    assert other.num_updates == 1 and torch.equal(other.shadow["lin.bias"], ema.shadow["lin.bias"])
    with pytest.raises(ValueError, match="does not match the model"):
        ModelEMA(torch.nn.Linear(3, 2), decay=0.99).load_state_dict(ema.state_dict())


def test_validation_uses_the_ema_and_training_does_not_see_it(tmp_path, monkeypatch, capsys):
    from megatron_dsv.training import trainer

    seen, built = [], []
    real_evaluate, real_build = trainer.evaluate, trainer._build_ema

    def spy(loss_model, ddp_model, *args, **kwargs):  # inside validation: the model holds the EMA
        ema = built[-1]
        if ema is not None:
            params = dict(trainer.unwrap(ddp_model).named_parameters())
            seen.append(all(torch.equal(params[n], ema.shadow[n]) for n in ema.names))
        return real_evaluate(loss_model, ddp_model, *args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate", spy)
    monkeypatch.setattr(trainer, "_build_ema", lambda args, model: built.append(real_build(args, model)) or built[-1])
    flags = ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1", "--no-save",
             "--dsv-stage-switch-steps", "2"]
    with_ema = run(tmp_path, *flags, name="ema")
    assert seen == [True, True] and with_ema.ema.num_updates == 4
    assert "| weights: EMA (decay 0.999) |" in capsys.readouterr().out
    live = run(tmp_path, *flags, "--ema-decay", "0", name="live")
    assert live.ema is None and "| weights: live |" in capsys.readouterr().out
    assert with_ema.losses == live.losses  # the EMA never touches training
    assert [v for _, v in with_ema.valid_losses] != [v for _, v in live.valid_losses]


def test_resume_reproduces_the_ema_and_its_validation_exactly(tmp_path):
    flags = ["--train-iters", "6", "--dsv-stage-switch-steps", "3", "--eval-interval", "2", "--eval-iters", "1"]
    full = run(tmp_path, *flags, "--no-save", name="full")
    ckpt = str(tmp_path / "ckpt")
    first = run(tmp_path, *flags, "--save", ckpt, "--exit-interval", "3", name="first")
    second = run(tmp_path, *flags, "--load", ckpt, "--no-save", name="second")
    assert first.losses + second.losses == full.losses
    assert first.valid_losses + second.valid_losses == full.valid_losses  # bit for bit
    assert second.ema.num_updates == full.ema.num_updates == 6
    for name in full.ema.names:
        assert torch.equal(second.ema.shadow[name], full.ema.shadow[name]), name
    state = json.load(open(tmp_path / "ckpt" / "iter_0000003" / "train_state.json"))
    assert state["ema"] == {"decay": 0.999, "warmup": True, "num_updates": 3}


@pytest.mark.parametrize("old", [False, True], ids=["saved-with-ema-decay-0", "saved-before-ema"])
def test_checkpoint_without_ema_loads_and_starts_the_ema_from_its_weights(tmp_path, capsys, old):
    ckpt = tmp_path / "ckpt"
    run(tmp_path, "--train-iters", "2", "--no-dsv", "--ema-decay", "0", "--save", str(ckpt), name="a")
    if old:  # a train_state.json written before --ema-decay existed has no "ema" key
        path = ckpt / "iter_0000002" / "train_state.json"
        state = json.load(open(path))
        del state["ema"]
        path.write_text(json.dumps(state))
    capsys.readouterr()
    resumed = run(tmp_path, "--train-iters", "3", "--no-dsv", "--load", str(ckpt), "--no-save",
                  "--use-checkpoint-opt_param-scheduler", name="b")
    out = capsys.readouterr().out
    assert out.count("holds no EMA of the weights") == 1 and "the EMA starts from the loaded weights" in out
    assert resumed.start_iteration == 2 and resumed.ema.num_updates == 1


def test_load_model_for_inference_can_take_the_ema(tmp_path):
    from megatron_dsv.training.checkpointing import CheckpointError, load_model_for_inference

    result = run(tmp_path, "--train-iters", "3", "--save", str(tmp_path / "ckpt"))
    model, _ = load_model_for_inference(str(tmp_path / "ckpt"), "cpu", ema=True)
    params = dict(model.named_parameters())
    for name in result.ema.names:
        assert torch.equal(params[name], result.ema.shadow[name]), name
    live = dict(result.model.named_parameters())
    assert any(not torch.equal(params[n], live[n]) for n in result.ema.names)
    run(tmp_path, "--train-iters", "1", "--ema-decay", "0", "--save", str(tmp_path / "plain"), name="plain")
    with pytest.raises(CheckpointError, match="holds no EMA"):
        load_model_for_inference(str(tmp_path / "plain"), "cpu", ema=True)
