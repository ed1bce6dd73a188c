#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU) and convert the bundled demo pair to GGUF f32, for
# scripts/llamacpp_compare.py.
#
#   scripts/llamacpp_build.sh [WORKDIR]        (default WORKDIR: ~/.cache/dflash-llamacpp)
#
# llama.cpp is the source vendored in the llama-cpp-python sdist (pinned below), downloaded with pip.
# Idempotent: an existing sdist, unpacked tree, llama-server binary or GGUF file is kept; pointing WORKDIR at
# a directory that already holds llama_cpp_python-$VERSION/ (unpacked, built or not) reuses it.
# Writes:  WORKDIR/llama_cpp_python-$VERSION/vendor/llama.cpp/build/bin/llama-server
#          WORKDIR/gguf/target-f32.gguf, WORKDIR/gguf/draft-f32.gguf   (draft converted with --target-model-dir)
#          WORKDIR/llamacpp.env   (LLAMA_SERVER=, TARGET_GGUF=, DRAFT_GGUF=, LLAMACPP_VERSION=)
# Environment: PYTHON (default: python; needs torch, numpy and transformers: the dflash-serve venv),
#              JOBS (build jobs; default: nproc).
set -euo pipefail

VERSION=0.3.36
WORKDIR=${1:-$HOME/.cache/dflash-llamacpp}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
JOBS=${JOBS:-$(nproc)}
TARGET_DIR=$REPO/dflash_core/demo_models/target
DRAFT_DIR=$REPO/dflash_core/demo_models/draft

mkdir -p "$WORKDIR"
WORKDIR=$(cd "$WORKDIR" && pwd)
SRC=$WORKDIR/llama_cpp_python-$VERSION
LLAMA=$SRC/vendor/llama.cpp
BUILD=$LLAMA/build
BIN=$BUILD/bin/llama-server
GGUF=$WORKDIR/gguf
PYDEPS=$WORKDIR/pydeps

log() { echo "[llamacpp_build] $*" >&2; }

# 1. source
if [ ! -f "$LLAMA/CMakeLists.txt" ]; then
    SDIST=$WORKDIR/llama_cpp_python-$VERSION.tar.gz
    if [ ! -f "$SDIST" ]; then
        log "downloading llama-cpp-python==$VERSION (sdist)"
        "$PYTHON" -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$WORKDIR"
    fi
    log "unpacking $SDIST"
    tar -xzf "$SDIST" -C "$WORKDIR"
else
    log "source present: $LLAMA"
fi

# 2. llama-server
if [ ! -x "$BIN" ]; then
    log "building llama-server ($JOBS jobs; tens of minutes on 2 cores)"
    cmake -S "$LLAMA" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build "$BUILD" --target llama-server -j"$JOBS"
else
    log "llama-server present: $BIN"
fi

# 3. the converter's Python deps: gguf from the tree (PYTHONPATH), sentencepiece (imported by the Qwen vocab
#    path even for a BPE tokenizer) into WORKDIR/pydeps unless importable already.
PYPATH=$LLAMA/gguf-py:$LLAMA
if ! "$PYTHON" -c "import sentencepiece" 2>/dev/null; then
    if [ ! -d "$PYDEPS/sentencepiece" ]; then
        log "installing sentencepiece into $PYDEPS"
        "$PYTHON" -m pip install --quiet --target "$PYDEPS" sentencepiece
    fi
    PYPATH=$PYPATH:$PYDEPS
fi

# The demo tokenizer's pre-tokenizer is Qwen2's regex + ByteLevel, but its vocabulary is its own, so the
# converter's hash lookup (get_vocab_base_pre) does not know it; when the regex is exactly Qwen2's, use "qwen2".
convert() {  # convert OUT MODEL_DIR [converter args...]
    local out=$1 model=$2
    shift 2
    if [ -s "$out" ]; then
        log "present: $out"
        return
    fi
    log "converting $model -> $out"
    PYTHONPATH=$PYPATH "$PYTHON" - "$LLAMA/convert_hf_to_gguf.py" "$model" --outtype f32 --outfile "$out.tmp" "$@" <<'EOF'
import json, runpy, sys
from pathlib import Path

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
import conversion.base as base

owner = next(c for c in vars(base).values() if isinstance(c, type) and "get_vocab_base_pre" in vars(c))
original = owner.get_vocab_base_pre

def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        tok = json.loads((Path(self.dir_model) / "tokenizer.json").read_text(encoding="utf-8"))
        pre = tok.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", [pre])
        regexes = [p.get("pattern", {}).get("Regex") for p in parts if p.get("type") == "Split"]
        if regexes == [QWEN2_REGEX] and any(p.get("type") == "ByteLevel" for p in parts):
            print("[llamacpp_build] unknown BPE hash, Qwen2 pre-tokenizer regex: tokenizer.ggml.pre = qwen2",
                  file=sys.stderr)
            return "qwen2"
        raise

owner.get_vocab_base_pre = get_vocab_base_pre
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
EOF
    mv "$out.tmp" "$out"
}

mkdir -p "$GGUF"
convert "$GGUF/target-f32.gguf" "$TARGET_DIR"
convert "$GGUF/draft-f32.gguf" "$DRAFT_DIR" --target-model-dir "$TARGET_DIR"

COMMIT=$(git -C "$LLAMA" rev-parse --short HEAD 2>/dev/null || true)
cat > "$WORKDIR/llamacpp.env" <<EOF
LLAMA_SERVER=$BIN
TARGET_GGUF=$GGUF/target-f32.gguf
DRAFT_GGUF=$GGUF/draft-f32.gguf
LLAMACPP_VERSION=llama-cpp-python $VERSION${COMMIT:+ (vendored llama.cpp $COMMIT)}
EOF
log "wrote $WORKDIR/llamacpp.env"
cat "$WORKDIR/llamacpp.env"
