#!/usr/bin/env bash
# Regenerate docker/requirements.lock: every runtime dependency of the image (pyproject.toml's [project]
# dependencies and its `bench` extra, since the image runs dflash-bench, + docker/requirements.in) pinned to one version with its sha256 hashes, resolved for the
# image's platform (CPython 3.11, linux x86_64) with the CPU build of torch.
#   pip install pip-tools && docker/lock.sh
# Run it with Python 3.11 on linux x86_64 (the image's python:3.11-slim). Extra arguments go to pip-compile,
# e.g. `docker/lock.sh --upgrade` or `docker/lock.sh --find-links DIR` (a folder holding the torch CPU wheel
# when download.pytorch.org cannot be reached).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
out=docker/requirements.lock
export CUSTOM_COMPILE_COMMAND="docker/lock.sh"

python - <<'PY'
import platform, sys
if sys.version_info[:2] != (3, 11) or platform.machine() != "x86_64" or sys.platform != "linux":
    sys.exit(f"docker/lock.sh: run with CPython 3.11 on linux x86_64 (this is {platform.python_version()} "
             f"{sys.platform} {platform.machine()}): the lock is resolved for the image's platform")
PY

pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-find-links --extra bench \
    --resolver=backtracking --newline=lf \
    --index-url https://pypi.org/simple --extra-index-url "$TORCH_CPU_INDEX" \
    --output-file "$out" "$@" pyproject.toml docker/requirements.in

# The CPU wheel's version is 2.13.0+cpu; pin the public version so that an image built from the CUDA index
# (torch 2.13.0+cu128 installed first, see the Dockerfile) keeps its torch: `torch==2.13.0` matches both.
sed -i -E 's/^torch==([0-9.]+)\+cpu /torch==\1 /' "$out"
grep -q '^torch==2\.13\.0 ' "$out" || { echo "docker/lock.sh: $out does not pin torch==2.13.0" >&2; exit 1; }
echo "wrote $out ($(grep -c '^[a-z0-9]' "$out") packages)"
