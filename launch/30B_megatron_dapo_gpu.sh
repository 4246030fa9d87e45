#!/usr/bin/env bash
# Qwen3-30B-A3B DAPO on N nodes x 8 NVIDIA GPUs (default 2 nodes): Megatron TP2 x EP8 actor, vLLM
# TP4+EP engines, colocated. Start Ray first (`ray start --head` on node 1, `ray start
# --address=HEAD_IP:6379` on the others), then run this on the head node.
# NNODES=4 bash launch/30B_megatron_dapo_gpu.sh [overrides]
# CONFIG, MODEL, TRAIN, VAL submit another run (launch/30B_vl_megatron_dapo_gpu.sh sets them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

RAY_DASHBOARD="${RAY_DASHBOARD:-http://127.0.0.1:8265}"
source launch/ray_cli.sh
ray_cli
NNODES="${NNODES:-2}"
CONFIG="${CONFIG:-qwen3_30b_a3b_megatron_gpu}"
MODEL="${MODEL:-$PWD/models/Qwen3-30B-A3B-Base}"
TRAIN="${TRAIN:-$PWD/data/dapo-math-17k.parquet}"
VAL="${VAL:-$PWD/data/aime-2024.parquet}"

"$RAY" job submit --address "$RAY_DASHBOARD" \
  --runtime-env-json '{"working_dir": ".", "env_vars": {"HF_HUB_OFFLINE": "1", "NCCL_CUMEM_ENABLE": "0"}}' -- \
  python -m dapo_megatron.main --config-name "$CONFIG" \
    trainer.nnodes="$NNODES" model.path="$MODEL" "data.train_files=[$TRAIN]" "data.val_files=[$VAL]" "$@"
