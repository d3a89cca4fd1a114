#!/usr/bin/env bash
# Makes .gpu/ for scripts/gpu_check.sh (the device machine has no network, and the device tool carries
# at most 64 MiB, the working tree included): the wheels our package needs there that its image lacks
# (gguf, diskcache); the llama-cpp-python 0.3.36 sdist minus what a CUDA build of the library and of
# llama-server does not read (.git/, models/, docs/, media/, benches/, .github/, the UI's tests, the
# OpenCL/SYCL/Vulkan backends) as .gpu/llama-src.tar.xz (~7 MB); and .gpu/prebuilt/ as it is, if
# scripts/build_cuda_prebuilt.sh made it (the CUDA build and llama-server: gpu_check.sh builds from the
# sources only where that build does not load). .gpu/ is git-excluded.
#   scripts/make_gpu_bundle.sh          # then: run with carry [".gpu"], see scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
PY="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

sdist="${DFLASH_LLAMA_SDIST:-$HOME/.cache/dflash-gguf/llama-server-$VERSION/llama_cpp_python-$VERSION.tar.gz}"
if [[ ! -f "$sdist" ]]; then
    "$PY" -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$tmp/dl"
    sdist="$tmp/dl/llama_cpp_python-$VERSION.tar.gz"
fi
tar xzf "$sdist" -C "$tmp"
mv "$tmp/llama_cpp_python-$VERSION" "$tmp/llama-src"
ll="$tmp/llama-src/vendor/llama.cpp"
rm -rf "$tmp/llama-src/.git" "$ll"/{models,docs,media,benches,.github} "$ll/tools/ui/tests" \
       "$ll"/ggml/src/ggml-{opencl,sycl,vulkan}

mkdir -p .gpu/whl
tar cJf .gpu/llama-src.tar.xz.tmp -C "$tmp" llama-src
mv .gpu/llama-src.tar.xz.tmp .gpu/llama-src.tar.xz
# the device image runs Python 3.12 (see /work/.library/device/KINDS.md); both wheels are pure Python
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl "gguf==0.19.0" "diskcache==5.6.3"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
ls -la .gpu .gpu/*/
# the device tool carries the working tree (tracked and untracked-not-ignored files) and .gpu: 64 MiB in all
tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
size=$(($(du -sbL .gpu | cut -f1) + tree))
echo "make_gpu_bundle: $size bytes travel (the working tree's $tree and .gpu)"
((size <= 64 * 1024 * 1024)) || { echo "make_gpu_bundle: over the 64 MiB the device tool carries" >&2; exit 1; }
