#!/usr/bin/env bash
# Qwen3-VL-30B-A3B DAPO on geo3k, 2x Atlas 800T A3 (16 NPUs): the text 30B script
# (30B_megatron_dapo_npu.sh: its Ray cluster, the reference run's Ascend environment) submitting
# qwen3_vl_30b_a3b_megatron_npu. DATA_DIR holds verl's geo3k parquet (geo3k/train.parquet and
# geo3k/test.parquet, from verl's examples/data_preprocess/geo3k.py).
#   DATA_DIR=/data bash launch/30B_vl_megatron_dapo_npu.sh [overrides]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA_DIR="${DATA_DIR:-$ROOT/data}"

CONFIG=qwen3_vl_30b_a3b_megatron_npu MODEL="${MODEL:-$ROOT/models/Qwen3-VL-30B-A3B-Instruct}" \
  TRAIN="${TRAIN:-$DATA_DIR/geo3k/train.parquet}" VAL="${VAL:-$DATA_DIR/geo3k/test.parquet}" \
  exec bash "$ROOT/launch/30B_megatron_dapo_npu.sh" "$@"
