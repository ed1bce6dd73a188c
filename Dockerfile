# dflash-serve: OpenAI-compatible server with DFlash speculative decoding.
# Python dependencies come from docker/requirements.lock (exact versions + sha256 hashes, resolved for the CPU
# torch build on linux/amd64; regenerate with docker/lock.sh). TORCH_INDEX_URL picks the torch flavour: the CPU
# wheel by default (the demo pair runs anywhere), a CUDA index for GPU hosts (CUDA comes with the wheels; the host
# needs only the NVIDIA driver and the NVIDIA container toolkit):
#   docker build -t dflash-serve:cpu .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t dflash-serve:cuda .
#   podman build --format docker -t dflash-serve:cpu .    # podman's default OCI format drops the HEALTHCHECK
#   docker run --rm --stop-timeout 60 -p 127.0.0.1:8000:8000 dflash-serve:cpu           # CPU demo pair
#   docker run --rm --stop-timeout 60 --gpus all -p 127.0.0.1:8000:8000 -e HF_TOKEN \
#       -v ~/.cache/huggingface:/home/dflash/.cache/huggingface dflash-serve:cuda --config /app/configs/qwen3-8b.yaml
# --stop-timeout 60: the server drains for up to its 30 s shutdown timeout after SIGTERM; a plain `docker stop` kills
# it after 10 s. Behind a package mirror: --build-arg PIP_INDEX_URL=https://mirror.example/simple (every package of
# the lock from the mirror, hash-checked as ever) and, where download.pytorch.org cannot be reached either,
# --build-arg TORCH_INDEX_URL=<a mirror of the PyTorch index> (the lock's extra index becomes that mirror).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
# a package mirror (PyPI's simple API); unset: PyPI. pip reads it from the environment, as ARGs are in RUN.
ARG PIP_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY docker/requirements.lock ./
# A non-CPU torch is installed first, by version (its hashes are not in the lock); the lock then sees it as
# satisfying `torch==2.13.0` and installs everything else, hash-checked, without resolving anything.
RUN python -m venv /opt/venv \
    && if [ -n "${PIP_INDEX_URL:-}" ]; then \
         sed -i "s|^--extra-index-url .*|--extra-index-url ${TORCH_INDEX_URL}|" requirements.lock; \
       fi \
    && if [ "${TORCH_INDEX_URL}" != "https://download.pytorch.org/whl/cpu" ]; then \
         pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
       fi \
    && pip install --require-hashes --no-deps -r requirements.lock
COPY pyproject.toml README.md ./
COPY dflash_core ./dflash_core
COPY server ./server
RUN pip install --no-deps --no-build-isolation . \
    && pip check

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="dflash-serve" \
      org.opencontainers.image.description="OpenAI-compatible server with DFlash speculative decoding"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/home/dflash/.cache/huggingface \
    DFLASH_HOST=0.0.0.0 \
    DFLASH_PORT=8000
RUN groupadd --gid 1000 dflash \
    && useradd --create-home --uid 1000 --gid 1000 --shell /usr/sbin/nologin dflash \
    && mkdir -p /home/dflash/.cache/huggingface \
    && chown -R dflash:dflash /home/dflash/.cache
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
COPY configs ./configs
COPY --chmod=0755 docker/entrypoint.sh /usr/local/bin/entrypoint.sh
USER 1000:1000
EXPOSE 8000
# the server stops within its shutdown timeout (30 s by default) after SIGTERM: `docker stop -t 60` (shutdown timeout + about 20 s)
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('DFLASH_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]
CMD ["--config", "/app/configs/demo.yaml"]
