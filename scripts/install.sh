#!/usr/bin/env bash
# Installs dflash-gguf into ./.venv (created if missing), on top of
# llama-cpp-python 0.3.36, whose libllama/ggml we link. Re-running is cheap:
# pip reuses its wheel cache for llama-cpp-python and our build folder (build/)
# makes the C++ rebuild incremental.
#
#   scripts/install.sh          # runtime only
#   scripts/install.sh --test   # plus pytest and the PyTorch reference (CPU torch)
#
# GPU: the ggml backends come from llama-cpp-python, so build it with them:
#   CMAKE_ARGS="-DGGML_CUDA=on" scripts/install.sh        (CUDA)
#   Apple Silicon builds Metal by default.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# llama-cpp-python first: our CMake build finds its ggml/llama package files
"${PIP[@]}" install "llama-cpp-python==0.3.36"
"${PIP[@]}" install "scikit-build-core>=0.10" "pybind11>=2.12" numpy "gguf==0.19.0" safetensors click tqdm
if [[ "${1:-}" == "--test" ]]; then
    # torch runs the tests' PyTorch reference only (CPU is enough); pinned so that an
    # already-installed or locally cached build is reused
    "$VENV/bin/python" -c "import torch" 2>/dev/null || "${PIP[@]}" install "torch==2.13.0"
    # transformers builds the tiny targets of each architecture from configs (tests/arch_targets.py);
    # upstream's convert_hf_to_gguf.py, which converts them, imports sentencepiece for llama-style vocabs
    "${PIP[@]}" install pytest matplotlib "transformers==5.24.0" sentencepiece
    # the lint and format checks (scripts/lint.sh, .pre-commit-config.yaml); pinned: a new release reformats
    "${PIP[@]}" install "ruff==0.14.0" "clang-format==21.1.2"
    # the client libraries tests/test_clients.py speaks to `dflash serve` with
    "${PIP[@]}" install openai anthropic langchain-openai lm-eval
fi
"${PIP[@]}" install --no-build-isolation --no-deps -e .
echo "installed: $("$VENV/bin/python" -c 'import dflash_gguf; print(dflash_gguf.__file__)')"
