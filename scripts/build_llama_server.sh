#!/usr/bin/env bash
# Build upstream `llama-server` from the llama-cpp-python 0.3.36 source
# distribution (the same llama.cpp that our libllama comes from), for the
# end-to-end test tests/test_llama_server.py.
#
#   scripts/build_llama_server.sh            # build (no-op when already built)
#   DFLASH_CACHE=/some/dir scripts/...       # change the cache root
#   JOBS=8 scripts/build_llama_server.sh     # more parallel compile jobs
#
# Result: ${DFLASH_CACHE:-$HOME/.cache/dflash-gguf}/llama-server-0.3.36/bin/llama-server
# (prints its path on the last line of stdout). Only the llama-server target is
# built; static libraries, Release, no network at build time (no UI download,
# no curl/openssl). ccache is used when present.
set -euo pipefail

VERSION=0.3.36
CACHE_ROOT="${DFLASH_CACHE:-$HOME/.cache/dflash-gguf}"
PREFIX="$CACHE_ROOT/llama-server-$VERSION"
BIN="$PREFIX/bin/llama-server"
JOBS="${JOBS:-2}"

if [[ -x "$BIN" ]]; then
    echo "llama-server already built" >&2
    echo "$BIN"
    exit 0
fi

mkdir -p "$PREFIX"
SDIST="$PREFIX/llama_cpp_python-$VERSION.tar.gz"
SRC="$PREFIX/src"
BUILD="$PREFIX/build"

# 1. the source distribution: a local copy if one is around, else pip download.
if [[ ! -f "$SDIST" ]]; then
    for cand in "${DFLASH_LLAMA_SDIST:-}" "/work/dl/llama_cpp_python-$VERSION.tar.gz"; do
        if [[ -n "$cand" && -f "$cand" ]]; then
            cp "$cand" "$SDIST.tmp" && mv "$SDIST.tmp" "$SDIST"
            break
        fi
    done
fi
if [[ ! -f "$SDIST" ]]; then
    PY="${PYTHON:-python3}"
    tmpdl="$(mktemp -d "$PREFIX/dl.XXXXXX")"
    "$PY" -m pip download --no-deps --no-build-isolation --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION" -d "$tmpdl"
    mv "$tmpdl/llama_cpp_python-$VERSION.tar.gz" "$SDIST"
    rm -rf "$tmpdl"
fi

# 2. unpack (only vendor/llama.cpp is needed).
LLAMA_SRC="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [[ ! -f "$LLAMA_SRC/CMakeLists.txt" ]]; then
    rm -rf "$SRC"
    mkdir -p "$SRC"
    tar -xzf "$SDIST" -C "$SRC" "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi

# 3. configure + build the one target.
launcher=()
if command -v ccache >/dev/null 2>&1; then
    launcher=(-DGGML_CCACHE=ON)
else
    launcher=(-DGGML_CCACHE=OFF)
fi

cmake -S "$LLAMA_SRC" -B "$BUILD" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_CURL=OFF \
    "${launcher[@]}" >&2

cmake --build "$BUILD" --target llama-server -j "$JOBS" >&2

mkdir -p "$PREFIX/bin"
cp "$BUILD/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
echo "built $BIN" >&2
echo "$BIN"
