"""List the tensors of a checkpoint: names, shapes, dtypes and layout.

    python checkpoint_tools/inspect.py DIR [--filter SUBSTRING] [--check]

DIR is an HF safetensors dir (config.json + model*.safetensors) or a Megatron dist checkpoint
(torch_dist: metadata.json + .metadata); for the latter the layout column gives the number of
saved chunks per tensor and the layout (TP/PP/EP) the checkpoint was written with, if known.
Reads headers and metadata only: fast on any checkpoint size, no Megatron import. `--check`
also reads every file of a dist checkpoint against its checksums.json (`train/integrity.py`).
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: the repo root replaces this folder on sys.path,
    # which would otherwise shadow the standard library's `inspect` with ours
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--filter", default="", help="only names containing this substring")
    p.add_argument("--check", action="store_true", help="dist checkpoint: also check every file's size and "
                   "CRC32 against checksums.json (reads every byte)")
    args = p.parse_args(argv)
    # torch loads once the arguments parse (the tables need it): --help and a usage error stay instant.
    from checkpoint_tools.tables import run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
