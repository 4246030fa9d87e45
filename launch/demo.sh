#!/usr/bin/env bash
# The README's demo command: set up .venv, then DAPO end to end on the tiny CPU configuration.
# Extra arguments are config overrides, e.g. `bash launch/demo.sh trainer.total_training_steps=10`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup_env.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m dapo_megatron.main --config-name quickstart "$@"
