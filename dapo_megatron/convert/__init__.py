"""Convert checkpoints between HF safetensors and Megatron-Core distributed checkpoints.

    python -m dapo_megatron.convert hf-to-mcore --hf-dir HF --out CKPT --tp 2 --ep 2
    python -m dapo_megatron.convert mcore-to-hf --ckpt CKPT --out HF2

The tool launches its own worker processes for the requested layout (gloo on CPU, the
accelerator when present). A Megatron checkpoint written at one layout loads at any other
(dist_checkpointing reshards). Output goes to a temporary folder next to --out, renamed when
complete, so an error never leaves a partial checkpoint. Bad input exits with code 2 and one
line naming the tensor or file.

The command line is this file and usage.py (standard library only, so --help is fast); run.py
checks the input and launches the ranks in the command's process; ranks.py is what each rank
runs, with Megatron.
"""
from __future__ import annotations

import atexit
import os
import sys

from dapo_megatron.convert.usage import build_parser, log_path
from dapo_megatron.train import forkserver


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    forkserver.start(log_path(args))  # the workers' imports run while this process checks the input
    # torch and the model classes load once the arguments parse: --help and a usage error stay
    # instant, and the forkserver starts importing first.
    from dapo_megatron.convert.run import convert
    return convert(args)


def _exit_now(code: int) -> None:
    """Exit without tearing down the imported modules (torch, transformers: ~0.6-1 s of a
    command that is done). The exit handlers still run first: multiprocessing's remove the
    forkserver socket and the queue semaphores."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(code)
