# dstool images, two targets (versions pinned here and in pyproject.toml):
#
#   docker build --target train -t dstool-train .   PyTorch + DeepSpeed for multi-node GPU training
#   docker build --target serve -t dstool-serve .   NGC Triton + the exported model_repository/ + the cache gateway
#
# `dstool export` the model first: the serve image copies model_repository/ as it is (exported with
# `--backend onnxruntime` to use the ONNX Runtime backend of the NGC image). docker-compose.yml runs
# the serving stack (Triton + gateway, Redis).

ARG PYTORCH_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.10-py3

# ---- the project's source, copied into both images
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY dstool/ /src/dstool/
COPY train/ /src/train/
COPY compress/ /src/compress/
COPY serve/ /src/serve/

# ---- train: NGC PyTorch (CUDA, NCCL, nvcc for DeepSpeed's JIT-built fused ops) + dstool + DeepSpeed 0.19.8
FROM ${PYTORCH_IMAGE} AS train
ENV DS_BUILD_OPS=0 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
WORKDIR /opt/dstool
COPY --from=source /src/ ./
# The image's own torch satisfies dstool's torch>=2.4: it is kept, not replaced by a PyPI build.
RUN python -m pip install --no-cache-dir "./[train]" \
    && python -c "import dstool, deepspeed, torch; print('dstool', dstool.__version__, 'torch', torch.__version__)"
WORKDIR /workspace
ENTRYPOINT ["dstool"]
CMD ["train", "--help"]

# ---- serve: NGC Triton (ONNX Runtime + python backends) with the repository and the gateway in front
FROM ${TRITON_IMAGE} AS serve
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1
WORKDIR /opt/dstool
COPY --from=source /src/ ./
# Only what serving needs (the `serve` extra: no torch, no DeepSpeed). Triton's python backend runs the
# tokenizer, detokenizer and generation models with this Python, so onnxruntime, the tokenizer and numpy<2
# go into the system interpreter.
RUN python3 -m pip install --no-cache-dir "./[serve]" \
    && python3 -c "import dstool.serve.server, dstool.serve.gateway, tritonclient.grpc, redis"
COPY model_repository/ /models/
# the gateway's KServe v2 HTTP (+ /metrics) and gRPC ports; Triton listens on internal ports only
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready')"]
ENTRYPOINT ["dstool", "serve", "--repository", "/models", "--tritonserver", "/opt/tritonserver/bin/tritonserver", "--host", "0.0.0.0", "--log-file", "/tmp/tritonserver.log"]
CMD ["--cache", "redis://redis:6379/0"]
