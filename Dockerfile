# syntax=docker/dockerfile:1
# dflash-serve: OpenAI-compatible server with DFlash speculative decoding.
# CUDA comes with the PyTorch wheels (the host needs only the NVIDIA driver and the NVIDIA container toolkit),
# so a plain Python base image serves both GPU and CPU builds; TORCH_INDEX_URL picks the wheel flavour.
#   docker build -t dflash-serve .                                                    # CUDA 12.8 wheels
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t dflash-serve:cpu .
#   docker run --gpus all -p 8000:8000 -e HF_TOKEN dflash-serve --config /app/configs/qwen3-8b.yaml
#   docker run -p 8000:8000 dflash-serve                                              # CPU demo pair
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY dflash_core ./dflash_core
COPY server ./server
RUN pip install --no-cache-dir .

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
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('DFLASH_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]
CMD ["--config", "/app/configs/demo.yaml"]
