"""`python -m dapo_megatron.evaluate --model M [--data F ...] [--n N] [key=value ...]`: score a model.

M is an HF folder, a tiny:// model, or a training checkpoint (`<run>/checkpoints/step_N`, exported
to HF first, as `convert mcore-to-hf` does). A checkpoint's run config (`<run>/config.yaml`) gives
the defaults: the validation files, lengths, `rollout.val_kwargs`, the engine and the reward; for
another model they come from `--config-name` (default: dapo). Generates n samples per prompt on
vLLM engines (the rollout's engine code), scores them with the reward table (math, geo3k, a
custom function), and prints per data_source avg@n, pass@k and maj@k (reward/metrics.py) for k in
powers of two up to n, the mean response length and the share cut at the length limit; writes
the generations (generations.jsonl) and the table (summary.json) under --out. Bad input (a data
file, a model path) is one `error:` line before anything starts.

The command line is this file (standard library only, so --help is instant); run.py does the rest.
"""
from __future__ import annotations

import argparse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dapo_megatron.evaluate", description=__doc__.splitlines()[0],
                                epilog="example: python -m dapo_megatron.evaluate --model "
                                       "outputs/dapo-megatron/quickstart/checkpoints/step_30 --n 8")
    p.add_argument("--model", required=True, help="HF folder, tiny://NAME, or a checkpoint step_N folder")
    p.add_argument("--data", nargs="*", default=None, help="parquet / jsonl files (default: data.val_files)")
    p.add_argument("--config-name", "-cn", default="dapo", help="defaults for a model that is not a checkpoint")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default: rollout.val_kwargs.n)")
    p.add_argument("--temperature", type=float, default=None, help="default: rollout.val_kwargs.temperature")
    p.add_argument("--top-p", type=float, default=None, help="default: rollout.val_kwargs.top_p")
    p.add_argument("--engines", type=int, default=1, help="engines (each rollout.parallel.tp devices)")
    p.add_argument("--batch", type=int, default=256, help="prompts per engine call (the progress bar's step)")
    p.add_argument("--out", default="", help="output folder (default: eval/<model name>)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data.max_response_length=4096")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # The config, torch, transformers and Ray load once the arguments parse: --help and a usage
    # error stay instant.
    from dapo_megatron.evaluate.run import evaluate
    return evaluate(args)
