#!/usr/bin/env bash
# Qwen3-VL-30B-A3B DAPO on geo3k, N nodes x 8 NVIDIA GPUs (default 2): the text 30B script
# (30B_megatron_dapo_gpu.sh: its Ray cluster and NNODES) submitting qwen3_vl_30b_a3b_megatron_gpu.
# DATA_DIR holds verl's geo3k parquet (geo3k/train.parquet and geo3k/test.parquet, from verl's
# examples/data_preprocess/geo3k.py).
#   DATA_DIR=/data bash launch/30B_vl_megatron_dapo_gpu.sh [overrides]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA_DIR="${DATA_DIR:-$ROOT/data}"

CONFIG=qwen3_vl_30b_a3b_megatron_gpu MODEL="${MODEL:-$ROOT/models/Qwen3-VL-30B-A3B-Instruct}" \
  TRAIN="${TRAIN:-$DATA_DIR/geo3k/train.parquet}" VAL="${VAL:-$DATA_DIR/geo3k/test.parquet}" \
  exec bash "$ROOT/launch/30B_megatron_dapo_gpu.sh" "$@"
