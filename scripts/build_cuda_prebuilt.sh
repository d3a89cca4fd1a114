#!/usr/bin/env bash
# Builds llama-cpp-python 0.3.36 with CUDA, and llama-server, on a machine with nvcc but no GPU, into
# .gpu/prebuilt/llama-cpp-python-cuda.tar.xz (the installed package, llama-server beside it), so that
# scripts/gpu_check.sh spends a device lease measuring instead of compiling (this build takes ~320 s of a
# 900 s lease on the device's 16 cores; ~26 min on 2 cores, off the lease). What a GPU-less machine lacks
# is fetched or stubbed, for the link only: cuBLAS from PyPI (nvidia-cublas of nvcc's major version) when
# the toolkit has none, and a libcuda.so.1 defining the driver calls ggml-cuda makes when no driver is
# installed. The device's own driver and cuBLAS serve them at run time (the libraries name only
# libcuda.so.1, libcudart.so.N and libcublas.so.N).
#   scripts/build_cuda_prebuilt.sh            # then scripts/make_gpu_bundle.sh (carries .gpu/prebuilt/)
#   CUDA_ARCH=90-real WORK=/tmp/cudabuild CUBLAS_DIR=$WORK/cublas CUDA_STUB_DIR=$WORK/cudastub   # the defaults
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
ARCH="${CUDA_ARCH:-90-real}"  # SASS for sm_90 only: PTX for later GPUs would not fit in what the device tool carries
WORK="${WORK:-/tmp/cudabuild}"
PY="${PYTHON:-$PWD/.venv/bin/python}"  # absolute: used after a cd too
OUTDIR="$PWD/.gpu/prebuilt"
command -v nvcc > /dev/null || { echo "build_cuda_prebuilt: no nvcc on PATH" >&2; exit 1; }
CUDA_MAJOR=$(nvcc --version | grep -oE 'release [0-9]+' | grep -oE '[0-9]+')
CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
mkdir -p "$WORK" "$OUTDIR"

sdist="${DFLASH_LLAMA_SDIST:-$HOME/.cache/dflash-gguf/llama-server-$VERSION/llama_cpp_python-$VERSION.tar.gz}"
[[ -f "$sdist" ]] || { "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$WORK"; sdist="$WORK/llama_cpp_python-$VERSION.tar.gz"; }
SRC="$WORK/llama_cpp_python-$VERSION"
[[ -d "$SRC" ]] || tar xzf "$sdist" -C "$WORK"

EXTRA=()
if ! find "$CUDA_ROOT" -name 'libcublas.so*' 2>/dev/null | grep -q .; then
    CUBLAS="${CUBLAS_DIR:-$WORK/cublas}"
    if [[ ! -d "$CUBLAS/nvidia" ]]; then
        "$PY" -m pip download -q --no-deps --only-binary=:all: "nvidia-cublas>=$CUDA_MAJOR,<$((CUDA_MAJOR + 1))" -d "$CUBLAS"
        (cd "$CUBLAS" && "$PY" -m zipfile -e nvidia_cublas-*.whl .)
    fi
    C=$(dirname "$(dirname "$(find "$CUBLAS/nvidia" -name cublas_v2.h | head -1)")")
    ln -sf libcublas.so."$CUDA_MAJOR" "$C/lib/libcublas.so"
    ln -sf libcublasLt.so."$CUDA_MAJOR" "$C/lib/libcublasLt.so"
    EXTRA+=(-DCUDA_cublas_LIBRARY="$C/lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$C/lib/libcublasLt.so"
            -DCMAKE_CUDA_FLAGS="-I$C/include" -DCMAKE_CXX_FLAGS="-I$C/include")
fi
if ! ldconfig -p | grep -q 'libcuda.so.1 ' && ! find "$CUDA_ROOT" -name 'libcuda.so' 2>/dev/null | grep -q .; then
    # every driver call ggml-cuda makes (cuda.h maps some to a _v2 symbol: both), defined so that the
    # linker keeps libcuda.so.1 among libggml-cuda.so's NEEDED (it drops a library it takes nothing from);
    # never run: the device's driver serves them
    STUB="${CUDA_STUB_DIR:-$WORK/cudastub}"
    mkdir -p "$STUB"
    grep -rhoE '\bcu[A-Z][A-Za-z0-9]*\(' "$SRC/vendor/llama.cpp/ggml/src/ggml-cuda" | tr -d '(' | sort -u \
        | sed 's/.*/int &(void) { return 100; }\nint &_v2(void) { return 100; }/' > "$STUB/stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$STUB/libcuda.so" "$STUB/stub.c"
    ln -sf libcuda.so "$STUB/libcuda.so.1"  # what llama-server's link looks for
    EXTRA+=(-DCUDA_cuda_driver_LIBRARY="$STUB/libcuda.so")
fi

ARGS=(-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF
      -DGGML_NATIVE=OFF "${EXTRA[@]}")
export CMAKE_ARGS="${ARGS[*]}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
rm -rf "$WORK/whl" "$WORK/site"
nice "$PY" -m pip wheel -q --no-deps --no-build-isolation -C build-dir="$WORK/build" "$SRC" -w "$WORK/whl"

# llama-server needs no CUDA compile of its own: built with shared libraries and no backend but the CPU,
# it loads the wheel's libggml.so.0 (the same sources and sonames, the CUDA backend registered in it) when
# gpu_check.sh puts the wheel's folders on LD_LIBRARY_PATH. (Reconfiguring the wheel's build tree for
# llama-server instead recompiles every object whose ninja deps record an interrupted build lost.)
cmake -S "$SRC/vendor/llama.cpp" -B "$WORK/server" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF > "$WORK/server_configure.log"
nice cmake --build "$WORK/server" --target llama-server > "$WORK/server_build.log"

# The wheel holds each library six times (three names, in lib/ and llama_cpp/lib/; 260 MB for sm_90), over
# what the device tool carries: installed, each copy becomes a link to one file, packed with xz.
"$PY" -m pip install -q --no-deps --no-compile --target "$WORK/site" "$WORK"/whl/llama_cpp_python-*.whl
"$PY" - "$WORK/site" <<'PY'
import hashlib, os, sys
from pathlib import Path
site = Path(sys.argv[1])
files = [p for d in ("llama_cpp/lib", "lib") for p in sorted((site / d).glob("*.so*")) if not p.is_symlink()]
groups = {}
for p in files:
    groups.setdefault(hashlib.sha256(p.read_bytes()).hexdigest(), []).append(p)
for same in groups.values():  # kept: llama_cpp/lib's file of the longest name (the full version)
    keep = max(same, key=lambda p: (p.parent == site / "llama_cpp" / "lib", len(p.name)))
    for p in same:
        if p != keep:
            p.unlink()
            p.symlink_to(os.path.relpath(keep, p.parent))
PY
# llama-server and the libraries of its build that the wheel lacks (gpu_check.sh runs it with
# LD_LIBRARY_PATH = this folder, llama_cpp/lib, lib: the wheel's libggml and libllama serve it)
SRV="$WORK/site/llama-server-bin"
mkdir -p "$SRV" "$OUTDIR"
cp "$WORK/server/bin/llama-server" "$WORK/server/bin/libllama-server-impl.so" "$SRV/"
cp -L "$WORK/server/bin/libmtmd.so.0" "$SRV/"
strip "$SRV"/* "$WORK"/site/llama_cpp/lib/*.so.*.*
tar cJf "$OUTDIR/llama-cpp-python-cuda.tar.xz.tmp" -C "$WORK/site" .
mv "$OUTDIR/llama-cpp-python-cuda.tar.xz.tmp" "$OUTDIR/llama-cpp-python-cuda.tar.xz"
ls -la "$OUTDIR"
