#!/usr/bin/env bash
# Smoke test of the container image, for machines with a container engine (not run in CI: it builds the image,
# which needs the network). Builds the image with docker (else podman), starts it on the bundled demo pair and
# checks: the HEALTHCHECK is in the image, the user is uid 1000, /health, a chat completion, a streamed one,
# /metrics, dflash-bench inside the image (its default output folder must be writable there), and a clean stop:
# `stop -t 60` ends the container by SIGTERM with exit code 0.
#   docker/smoke.sh                                  # docker if installed, else podman; CPU torch
#   ENGINE=podman docker/smoke.sh
#   IMAGE=dflash-serve:cpu SKIP_BUILD=1 docker/smoke.sh     # an image built already
#   PIP_INDEX_URL=https://mirror.example/simple docker/smoke.sh                 # packages from a mirror
#   docker/smoke.sh --network host --build-arg HTTPS_PROXY=http://proxy:3128   # any build options
# Arguments are passed to `$ENGINE build` as they are (not allowed with SKIP_BUILD=1).
# Settings (environment): ENGINE, IMAGE (default dflash-serve:smoke), PORT (host port on 127.0.0.1, default
# 18000), TORCH_INDEX_URL (default the CPU wheels), PIP_INDEX_URL (a package mirror; default: none, PyPI),
# SKIP_BUILD=1, START_TIMEOUT (seconds, default 300).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${ENGINE:-}" ]; then
    if command -v docker >/dev/null 2>&1; then ENGINE=docker; else ENGINE=podman; fi
fi
command -v "$ENGINE" >/dev/null 2>&1 || { echo "smoke: neither docker nor podman found" >&2; exit 2; }
command -v curl >/dev/null 2>&1 || { echo "smoke: curl is needed" >&2; exit 2; }
IMAGE=${IMAGE:-dflash-serve:smoke}
PORT=${PORT:-18000}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
START_TIMEOUT=${START_TIMEOUT:-300}
NAME="dflash-smoke-$$"
BASE="http://127.0.0.1:${PORT}"
PROMPT='Convert 5 kilometers to meters.'   # the demo pair answers it: "... = 5000 meters."

step() { printf '\n== %s\n' "$*"; }
fail() {
    echo "smoke: FAILED: $*" >&2
    "$ENGINE" logs --tail 40 "$NAME" >&2 2>&1 || true
    exit 1
}
cleanup() { "$ENGINE" rm -f "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    step "build $IMAGE with $ENGINE (TORCH_INDEX_URL=$TORCH_INDEX_URL${PIP_INDEX_URL:+, PIP_INDEX_URL=$PIP_INDEX_URL})"
    build_args=(build --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL}" -t "$IMAGE")
    if [ -n "${PIP_INDEX_URL:-}" ]; then build_args+=(--build-arg "PIP_INDEX_URL=${PIP_INDEX_URL}"); fi
    # podman's default OCI image format has no HEALTHCHECK: build in docker format
    if [ "$ENGINE" = podman ]; then build_args+=(--format docker); fi
    "$ENGINE" "${build_args[@]}" "$@" .
elif [ "$#" -gt 0 ]; then
    echo "smoke: build options ($*) given with SKIP_BUILD=1" >&2
    exit 2
fi

step "image metadata"
healthcheck=$("$ENGINE" image inspect --format '{{json .Config.Healthcheck}}' "$IMAGE")
case "$healthcheck" in
    *"/health"*) echo "HEALTHCHECK: $healthcheck" ;;
    *) fail "the image has no HEALTHCHECK (podman: build with --format docker): $healthcheck" ;;
esac

step "start $NAME on 127.0.0.1:$PORT"
"$ENGINE" run -d --name "$NAME" -p "127.0.0.1:${PORT}:8000" "$IMAGE" >/dev/null
uid=$("$ENGINE" exec "$NAME" id -u)
[ "$uid" = 1000 ] || fail "the server runs as uid $uid, not 1000"

step "wait for /health (up to ${START_TIMEOUT} s)"
ready=0
for _ in $(seq 1 "$START_TIMEOUT"); do
    if curl -fsS "$BASE/health" >/dev/null 2>&1; then ready=1; break; fi
    running=$("$ENGINE" inspect --format '{{.State.Running}}' "$NAME")
    [ "$running" = true ] || fail "the container exited while starting"
    sleep 1
done
[ "$ready" = 1 ] || fail "/health not ready after ${START_TIMEOUT} s"
curl -fsS "$BASE/health"; echo

step "chat completion"
body=$(printf '{"model": "dflash-demo", "messages": [{"role": "user", "content": "%s"}], "max_tokens": 64, "temperature": 0}' "$PROMPT")
chat=$(curl -fsS "$BASE/v1/chat/completions" -H 'Content-Type: application/json' -d "$body")
echo "$chat"
case "$chat" in *'"finish_reason":"stop"'*) ;; *) fail "chat: no finish_reason stop" ;; esac
case "$chat" in *5000*) ;; *) fail "chat: the answer lacks 5000" ;; esac
case "$chat" in *'"mean_acceptance_length"'*) ;; *) fail "chat: no dflash summary" ;; esac

step "streamed chat completion"
sbody=$(printf '{"model": "dflash-demo", "messages": [{"role": "user", "content": "%s"}], "max_tokens": 64, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}' "$PROMPT")
stream=$(curl -fsSN "$BASE/v1/chat/completions" -H 'Content-Type: application/json' -d "$sbody")
events=$(printf '%s\n' "$stream" | grep -c '^data: ' || true)
last=$(printf '%s\n' "$stream" | grep '^data: ' | tail -n 1)
echo "$events events, last: $last"
[ "$events" -ge 3 ] || fail "stream: only $events SSE events"
[ "$last" = "data: [DONE]" ] || fail "stream: does not end with data: [DONE]"
printf '%s\n' "$stream" | grep -q '"completion_tokens"' || fail "stream: no usage chunk"

step "metrics"
metrics=$(curl -fsS "$BASE/metrics")
for name in dflash_generation_tokens_total dflash_spec_decode_num_drafts_total dflash_requests_total; do
    line=$(printf '%s\n' "$metrics" | grep "^${name}" | head -n 1 || true)
    [ -n "$line" ] || fail "metrics: no $name"
    echo "$line"
done

step "dflash-bench serve inside the image (uid 1000, working folder /app is read-only to it)"
"$ENGINE" exec "$NAME" dflash-bench serve --base-url http://127.0.0.1:8000/v1 --concurrency 1 --num-prompts 2 \
    --max-tokens 16 --repeats 1 --min-duration 0 --no-plots --no-progress \
    || fail "dflash-bench serve failed inside the image"

step "clean stop: $ENGINE stop -t 60"
start=$(date +%s)
"$ENGINE" stop -t 60 "$NAME" >/dev/null
took=$(( $(date +%s) - start ))
code=$("$ENGINE" inspect --format '{{.State.ExitCode}}' "$NAME")
echo "stopped in ${took} s, exit code $code"
[ "$code" = 0 ] || fail "exit code $code after SIGTERM (expected 0: a graceful shutdown)"
[ "$took" -lt 60 ] || fail "the stop took ${took} s: SIGTERM did not end the server before the 60 s kill"

printf '\nsmoke: all checks passed (%s, %s)\n' "$ENGINE" "$IMAGE"
