#!/usr/bin/env bash
# Fill .gpu-wheels (git-ignored) with the wheels `scripts/gpu_check.sh --quick` installs on a GPU host that has
# torch and transformers but no package index and no server stack: CPython 3.12, manylinux x86-64, no
# dependencies resolved (the host's own numpy, torch, transformers, tokenizers, httpx, anyio, click, h11 are kept).
# Run it on a machine that reaches the package index; it checks the folder stays under 64 MiB (what a borrowed
# GPU host takes along with the working tree) and prints the total.
#
#   scripts/gpu_wheels.sh [DIR]    (default DIR: .gpu-wheels)
#
# The versions are docker/requirements.lock's, inside pyproject.toml's ranges.
set -euo pipefail
cd "$(dirname "$0")/.."

dir="${1:-.gpu-wheels}"
limit=$((64 * 1024 * 1024))
python="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; fi

packages=()
for name in fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection \
            typing-extensions uvicorn sse-starlette llguidance opentelemetry-api; do
  pin=$(grep -iE "^${name}==" docker/requirements.lock | head -n1 | cut -d' ' -f1 || true)
  if [ -z "$pin" ]; then echo "gpu_wheels.sh: $name is not in docker/requirements.lock" >&2; exit 1; fi
  packages+=("$pin")
done

platforms=()
for tag in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_28_x86_64 \
           manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  platforms+=(--platform "$tag")
done

rm -rf "$dir"
mkdir -p "$dir"
"$python" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --no-deps \
  "${platforms[@]}" -d "$dir" "${packages[@]}"

total=$(find "$dir" -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
ls -l "$dir"
echo "gpu_wheels.sh: $(find "$dir" -name '*.whl' | wc -l) wheels, $total bytes ($((total / 1024)) KiB) in $dir"
if [ "$total" -ge "$limit" ]; then
  echo "gpu_wheels.sh: $dir is over 64 MiB: a borrowed GPU host cannot take it along" >&2
  exit 1
fi
