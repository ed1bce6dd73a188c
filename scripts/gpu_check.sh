#!/usr/bin/env bash
# One-command GPU readiness check: a test subset on CUDA, then step timings (plain, verify at widths 4/8/16,
# draft; batch 1/4/16/32; eager and compiled) for random-weight bf16 targets shaped like Qwen3-8B and Qwen3.5-9B,
# peak memory and the physical anchors. Writes gpu_check.json and gpu_check.png to OUTPUT_DIR.
#
#   scripts/gpu_check.sh [--dry-run] [OUTPUT_DIR]    (default OUTPUT_DIR: gpu-check)
#
# --dry-run: tiny shapes on CPU, eager only, no tests (what CI runs, so this script cannot rot). Without CUDA and
# without --dry-run it exits 2 with a clear message.
set -euo pipefail
cd "$(dirname "$0")/.."

dry=()
out="gpu-check"
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=(--dry-run) ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $arg" >&2; exit 2 ;;
    *) out="$arg" ;;
  esac
done

python="${PYTHON:-python}"
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; fi
exec "$python" -m dflash_core.bench gpu-check "${dry[@]}" --output-dir "$out"
