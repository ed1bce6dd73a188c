#!/usr/bin/env bash
# One-command GPU readiness check: a test subset on CUDA, then step timings (plain, verify at widths 4/8/16,
# draft; batch 1/4/16/32; eager and compiled) for random-weight bf16 targets shaped like Qwen3-8B and Qwen3.5-9B,
# peak memory and the physical anchors. Writes gpu_check.json and gpu_check.png to OUTPUT_DIR.
#
#   scripts/gpu_check.sh [--quick] [--dry-run] [OUTPUT_DIR]    (default OUTPUT_DIR: gpu-check)
#
# --quick: for a borrowed GPU host with torch and transformers but no package index: installs the wheels that
# scripts/gpu_wheels.sh put in .gpu-wheels (into a folder of its own, the host's packages kept), runs from this
# tree, and times a Qwen3-8B-shaped target with a 5-layer b16 draft (batch 1/8/32, widths 1/4/16, eager and
# compiled), then the server's app end to end, DFlash with a scripted drafter against --no-speculative at
# concurrency 1/8/32; no test subset. Within 8 minutes on an H200.
# --dry-run: tiny shapes on CPU, eager only, no tests (what CI runs, so this script cannot rot). Without CUDA and
# without --dry-run it exits 2 with a clear message.
set -euo pipefail
cd "$(dirname "$0")/.."

flags=()
quick=0
out="gpu-check"
for arg in "$@"; do
  case "$arg" in
    --dry-run) flags+=(--dry-run) ;;
    --quick) flags+=(--quick); quick=1 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $arg" >&2; exit 2 ;;
    *) out="$arg" ;;
  esac
done

python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python
  elif command -v python3 >/dev/null; then python=python3
  else python=python
  fi
fi

wheels="${GPU_WHEELS:-.gpu-wheels}"
if [ "$quick" = 1 ] && [ -d "$wheels" ]; then
  site="${GPU_CHECK_SITE:-/tmp/gpu-check-site}"
  echo "gpu_check.sh: installing $(find "$wheels" -name '*.whl' | wc -l) wheels from $wheels into $site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$wheels"/*.whl
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
elif [ "$quick" = 1 ]; then
  echo "gpu_check.sh: no $wheels folder (scripts/gpu_wheels.sh fills it); using the installed packages" >&2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
fi
exec "$python" -m dflash_core.bench gpu-check "${flags[@]}" --output-dir "$out"
