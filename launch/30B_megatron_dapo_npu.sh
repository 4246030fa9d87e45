#!/usr/bin/env bash
# Qwen3-30B-A3B DAPO on 2x Atlas 800T A3 (16 NPUs): Megatron TP4 x PP2 x EP8 actor, vllm-ascend
# TP8+EP engines in eager mode, colocated. Run on the head node of a Ray cluster started with
#   ray start --head --resources='{"NPU": 8}'            (node 1)
#   ray start --address=HEAD_IP:6379 --resources='{"NPU": 8}'   (node 2)
# Overrides after the script name go to the trainer, e.g. `bash ... trainer.total_training_steps=10`.
# CONFIG, MODEL, TRAIN, VAL submit another run (launch/30B_vl_megatron_dapo_npu.sh sets them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

RAY_DASHBOARD="${RAY_DASHBOARD:-http://127.0.0.1:8265}"
source launch/ray_cli.sh
ray_cli
CONFIG="${CONFIG:-qwen3_30b_a3b_megatron_npu}"
MODEL="${MODEL:-$PWD/models/Qwen3-30B-A3B-Base}"
TRAIN="${TRAIN:-$PWD/data/dapo-math-17k.parquet}"
VAL="${VAL:-$PWD/data/aime-2024.parquet}"
ASCEND="${ASCEND_HOME:-/usr/local/Ascend}"
# The reference runs' jemalloc is /usr/local/lib/libjemalloc.so.2; distributions put it in /usr/lib/<arch>.
# (`|| true`: with none found, pipefail would end the script here, silently.)
JEMALLOC="${JEMALLOC:-$(ls /usr/local/lib/libjemalloc.so.2 /usr/lib/*/libjemalloc.so.2 2>/dev/null | head -n1 || true)}"

# The environment of the reference Ascend DAPO runs (see docs/recipes/qwen3-30b-a3b.md): jemalloc against host
# memory fragmentation, vLLM V1, long HCCL connect timeout for 16-rank start-up, NZ weight format
# off and eager kernels so that weight updates reach the engine. The data plane (TransferQueue,
# data_plane.* in the config) carries the batches: its warnings are not for the job's log.
ENV_JSON=$(cat <<JSON
{"working_dir": ".",
 "env_vars": {"LD_PRELOAD": "${JEMALLOC}", "VLLM_USE_V1": "1", "HCCL_CONNECT_TIMEOUT": "5400",
              "HCCL_OP_EXPANSION_MODE": "AIV", "VLLM_ASCEND_ENABLE_NZ": "0", "USE_OPTIMIZED_MODEL": "0",
              "CPU_AFFINITY_CONF": "2", "ASCEND_HOME": "${ASCEND}", "HF_HUB_OFFLINE": "1",
              "TQ_LOGGING_LEVEL": "ERROR"}}
JSON
)

# The overrides, each quoted again for the `bash -c` line below (one with spaces stays one).
EXTRA=""
if (($#)); then EXTRA=$(printf '%q ' "$@"); fi

"$RAY" job submit --address "$RAY_DASHBOARD" --runtime-env-json "$ENV_JSON" -- \
  bash -c "source ${ASCEND}/ascend-toolkit/set_env.sh && source ${ASCEND}/nnal/atb/set_env.sh && \
  python -m dapo_megatron.main --config-name ${CONFIG} \
    model.path=${MODEL} 'data.train_files=[${TRAIN}]' 'data.val_files=[${VAL}]' ${EXTRA}"
