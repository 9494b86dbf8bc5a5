#!/usr/bin/env bash
# Builds llama.cpp's Python binding (llama-cpp-python, with its OpenAI-compatible server) from the
# package index into a virtual environment of its own, .venv-llama-cpp/ at the repository root,
# for the checks and benchmarks that read gptforge's GGUF files with llama.cpp itself
# (benchmarks/check_gguf_llama_cpp.py, benchmarks/bench_serve_llama_cpp.py). It compiles
# llama.cpp with the machine's C++ compiler and cmake: about 8 minutes on 2 cores, once; never
# part of `make install`. A second run with the environment in place does nothing.
#
#   benchmarks/llama_cpp_env.sh            # builds .venv-llama-cpp (or says it is there)
#   LLAMA_CPP_VENV=/path benchmarks/llama_cpp_env.sh
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${LLAMA_CPP_VENV:-$ROOT/.venv-llama-cpp}"
PYTHON="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
    echo "llama-cpp-python $VERSION is already built in $VENV"
    exit 0
fi
command -v cmake >/dev/null || { echo "error: cmake is not installed (llama-cpp-python builds llama.cpp with it)" >&2; exit 2; }
command -v c++ >/dev/null || { echo "error: no C++ compiler (c++) on PATH" >&2; exit 2; }

echo "building llama-cpp-python $VERSION into $VENV (compiles llama.cpp: minutes)"
start=$(date +%s)
# Built in place (a venv's scripts name their folder); a failed build leaves no half environment.
rm -rf "$VENV"
trap 'rm -rf "$VENV"; echo "error: the llama-cpp-python build failed (its log is above)" >&2' ERR
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# CPU build, native instructions of this machine (llama.cpp's default); all cores.
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$VENV/bin/pip" install --no-cache-dir "llama-cpp-python[server]==$VERSION"
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
trap - ERR
echo "built in $(( $(date +%s) - start )) s: $VENV/bin/python -m llama_cpp.server --model FILE.gguf"
