"""Run by tests/megatron_lm/test_megatron_lm_cpu.py in a subprocess, from a patched Megatron-LM tree on
PYTHONPATH (core_v0.16.1): Megatron-LM's own argument parsing, gpt_builder, the step-end hook and its
checkpoint functions, on one gloo process on the CPU. Writes its findings as JSON to argv[1].

Two CPU shims, both for CUDA-only calls around what is tested: ``get_rng_state`` (the CUDA RNG state does
not exist on a CPU torch; the run passes --no-save-rng) and ``read_metadata`` (it all-reduces the tracker's
iteration in a CUDA tensor). Format ``torch`` (torch_dist's writer synchronises CUDA; the GPU check covers it).
"""

import argparse
import contextlib
import io
import json
import sys
import tempfile


def _dsv_argv():
    """Every --dsv-* flag of megatron_dsv's parser with its default value spelled out (store_true flags set)."""
    from megatron_dsv.arguments import add_dsv_args

    own = add_dsv_args(argparse.ArgumentParser())
    argv = []
    for action in own._actions:
        flag = next((s for s in action.option_strings if s.startswith("--dsv-")), None)
        if flag is None:
            continue
        if action.nargs == 0:
            argv.append(flag)
        elif action.default is not None:
            values = action.default if isinstance(action.default, (list, tuple)) else [action.default]
            argv += [flag, *map(str, values)]
    return own, argv


def main():
    out_path, ckpt = sys.argv[1], tempfile.mkdtemp(prefix="dsv-mlm-ckpt-")
    import torch
    import torch.distributed as dist

    store = tempfile.NamedTemporaryFile(prefix="dsv-gloo-", delete=False).name
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store}")
    own, dsv_argv = _dsv_argv()
    base = ["pretrain_gpt.py", "--use-dsv-attention", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "2", "--kv-channels", "64", "--seq-length", "256",
            "--max-position-embeddings", "256", "--position-embedding-type", "learned_absolute",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "20", "--lr", "1e-4",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--mock-data", "--attention-dropout", "0.0",
            "--eval-interval", "10", "--eval-iters", "1", "--use-cpu-initialization", "--log-interval", "1",
            "--transformer-impl=local", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-persist-layer-norm",
            "--save", ckpt, "--load", ckpt, "--save-interval", "10", "--ckpt-format", "torch",
            "--no-save-rng", "--no-load-rng", "--no-save-optim", "--no-load-optim"]
    sys.argv = base + dsv_argv + ["--dsv-query-group-shape", "2", "4", "8", "--dsv-kv-block-size", "64",
                                  "--dsv-profile-interval", "1", "--dsv-predictor-query-stride", "8"]
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    from megatron_dsv.arguments import dsv_config_from_args

    args = parse_args()
    args.world_size, args.rank = 1, 0
    validate_args(args, {})
    set_global_variables(args, build_tokenizer=False)
    args.padded_vocab_size = 128
    mine = own.parse_args(sys.argv[len(base):] + ["--use-dsv-attention"])
    result = {"dsv_flags": [a for a in dsv_argv if a.startswith("--dsv-")],
              "config_equal": dsv_config_from_args(args) == dsv_config_from_args(mine)}

    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    from gpt_builders import gpt_builder

    from megatron_dsv.attention import DSVCoreAttention, dsv_layers
    from megatron_dsv.training.megatron_lm import dsv_train_step_end, dsv_train_step_prefetch

    torch.manual_seed(0)
    model = gpt_builder(args, True, True, config=core_transformer_config_from_args(args))
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    result["core_attention"] = [type(c).__name__ for c in cores]
    result["dsv_config_in_layers"] = all(isinstance(c, DSVCoreAttention) and c.dsv_config == dsv_config_from_args(args)
                                         for c in cores)
    tokens = torch.randint(0, 128, (1, 256))
    position_ids = torch.arange(256)[None]
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        result["prefetched"] = []
        for iteration in (1, 2, 3):  # what patch 0005 runs before each optimizer step and 0003 after it
            model(tokens, position_ids, None, labels=tokens).float().mean().backward()
            result["prefetched"].append(dsv_train_step_prefetch([model], args))
            dsv_train_step_end([model], iteration, args)
    result["dsv_lines"] = [line for line in log.getvalue().splitlines() if "[dsv]" in line]

    import megatron.training.checkpointing as checkpointing

    checkpointing.get_rng_state = lambda *a, **k: None
    checkpointing.read_metadata = lambda path: (int(open(path).read().strip()), False)
    with contextlib.redirect_stdout(io.StringIO()):
        checkpointing.save_checkpoint(3, [model], None, None, 0)
    fresh = gpt_builder(args, True, True, config=core_transformer_config_from_args(args))
    saved = {k: v for k, v in model.state_dict().items() if ".core_attention." in k and torch.is_tensor(v)}

    def differing(other):
        state = other.state_dict()
        return sorted(k for k in saved if not torch.equal(saved[k], state[k]))

    result["dsv_tensors"] = sorted(saved)
    result["differ_before_load"] = differing(fresh)
    with contextlib.redirect_stdout(io.StringIO()):
        iteration, _ = checkpointing.load_checkpoint([fresh], None, None)
    result["loaded_iteration"] = iteration
    result["differ_after_load"] = differing(fresh)
    result["host_mirrors"] = [(layer.step_host, layer.stage_host, layer.profiled_host) for layer in dsv_layers(fresh)]
    result["host_mirrors_saved"] = [(layer.step_host, layer.stage_host, layer.profiled_host)
                                    for layer in dsv_layers(model)]
    with open(out_path, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
