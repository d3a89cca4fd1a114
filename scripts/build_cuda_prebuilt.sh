#!/usr/bin/env bash
# Builds llama-cpp-python 0.3.36 with CUDA and its llama-server here, on a machine with nvcc but no GPU,
# into .gpu/prebuilt/, so that scripts/gpu_check.sh spends a device lease measuring instead of compiling
# (that build takes ~320 s of a 900 s lease on the device's 16 cores; ~50 min on 2 cores here, in the
# background). What a GPU-less machine lacks is fetched or stubbed for the link only: cuBLAS from PyPI
# (nvidia-cublas of nvcc's major version) when the toolkit has none, and a libcuda.so.1 stub defining the
# driver calls ggml-cuda makes when no driver is installed. The device's own driver and cuBLAS serve them at
# run time (the built libraries name only libcuda.so.1, libcudart.so.N, libcublas.so.N).
#   scripts/build_cuda_prebuilt.sh            # then scripts/make_gpu_bundle.sh (carries .gpu/prebuilt/)
#   CUDA_ARCH=90 WORK=/tmp/cudabuild CUBLAS_DIR=$WORK/cublas CUDA_STUB_DIR=$WORK/cudastub   # the defaults
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
ARCH="${CUDA_ARCH:-90}"
WORK="${WORK:-/tmp/cudabuild}"
PY="${PYTHON:-.venv/bin/python}"
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
    # only its name goes into libggml-cuda.so (NEEDED libcuda.so.1); the driver calls stay undefined until
    # the device's driver defines them
    STUB="${CUDA_STUB_DIR:-$WORK/cudastub}"
    mkdir -p "$STUB"
    echo 'void dflash_libcuda_stub(void) {}' > "$STUB/stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$STUB/libcuda.so" "$STUB/stub.c"
    EXTRA+=(-DCUDA_cuda_driver_LIBRARY="$STUB/libcuda.so")
fi

ARGS=(-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF
      -DGGML_NATIVE=OFF "${EXTRA[@]}")
export CMAKE_ARGS="${ARGS[*]}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
rm -f "$OUTDIR"/llama_cpp_python-*.whl
nice "$PY" -m pip wheel -q --no-deps --no-build-isolation -C build-dir="$WORK/build" "$SRC" -w "$OUTDIR"

# llama-server on the same objects; it finds the wheel's libraries through LD_LIBRARY_PATH on the device.
# Its link may leave the libraries' driver and cuBLAS calls undefined (stubbed or fetched above).
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$WORK/server_configure.log"
nice cmake --build "$WORK/build" --target llama-server > "$WORK/server_build.log"
cp "$(find "$WORK/build" -name llama-server -type f -perm -u+x | head -1)" "$OUTDIR/llama-server"
strip "$OUTDIR/llama-server"
ls -la "$OUTDIR"
