#!/usr/bin/env bash
# The README's test command: set up .venv, then the whole suite (fast unit tests first, then the
# multi-process Megatron tests, then end to end). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup_env.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
dirs=(); for d in tests/unit tests/distributed tests/e2e tests/gpu; do [ -d "$d" ] && dirs+=("$d"); done
exec .venv/bin/python -m pytest "${dirs[@]}" -q "$@"
