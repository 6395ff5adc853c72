# dstool images, two targets (versions pinned here and in pyproject.toml):
#
#   docker build --target train -t dstool-train .   PyTorch + DeepSpeed for multi-node GPU training
#   docker build --target serve -t dstool-serve .   NGC Triton + the exported model_repository/ + the cache gateway
#
# `dstool export` the model first: the serve image copies model_repository/ as it is (exported with
# `--backend onnxruntime` to use the ONNX Runtime backend of the NGC image). docker-compose.yml runs
# the serving stack (Triton + gateway, Redis).
#
# Without NGC (no GPU, no registry): `serve` also builds on a plain Debian bookworm base, with
#   --build-arg TRITON_IMAGE=dstool-base:bookworm --build-arg TRITONSERVER=
# An empty TRITONSERVER says the base has no Triton: python3 comes from apt and `dstool serve` runs the
# tritonserver of the nvidia-pytriton wheel (python backend only; export with the default `--backend python`).
# scripts/images.sh builds that image here and runs it with docker-compose.cpu.yml (see docs/images.md).

ARG PYTORCH_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.10-py3

# ---- the project's source, copied into both images
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY dstool/ /src/dstool/
COPY cli/ /src/cli/
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
# The base image's tritonserver; empty: the base has none (plain Debian bookworm, whose python3 is 3.11, a version
# the wheel ships a python backend stub for): Python is installed with apt and dstool serve finds the wheel's server.
ARG TRITONSERVER=/opt/tritonserver/bin/tritonserver
ENV DSTOOL_TRITONSERVER=${TRITONSERVER} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1
# Debian's own python3 (bookworm: 3.11) and the libpython3.11 the python backend stub links against;
# the versions are those of the base's Debian point release.
# hadolint ignore=DL3008
RUN if [ -z "${TRITONSERVER}" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-pip libpython3.11 \
        && rm -rf /var/lib/apt/lists/*; \
    fi
WORKDIR /opt/dstool
COPY --from=source /src/ ./
# Only what serving needs (the `serve` extra: no torch, no DeepSpeed). Triton's python backend runs the
# tokenizer, detokenizer and generation models with this Python, so onnxruntime, the tokenizer and numpy<2
# go into the system interpreter.
# (-I: the check imports the installed package, not the source folder ./dstool beside it)
RUN python3 -m pip install --no-cache-dir "./[serve]" \
    && python3 -I -c "import dstool.serve.runtime.server, dstool.serve.gateway, tritonclient.grpc, redis"
COPY model_repository/ /models/
# out of the source folder, whose ./dstool would shadow the installed package for `python3 -c` and the like
WORKDIR /
# the gateway's KServe v2 HTTP (+ /metrics) and gRPC ports; Triton listens on internal ports only
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready')"]
# --tritonserver: $DSTOOL_TRITONSERVER (the NGC image's), else the nvidia-pytriton wheel's
ENTRYPOINT ["dstool", "serve", "--repository", "/models", "--host", "0.0.0.0", "--log-file", "/tmp/tritonserver.log"]
CMD ["--cache", "redis://redis:6379/0"]
