#!/usr/bin/env bash
# The draft graph on a real non-CPU ggml backend, without a GPU: ggml's Vulkan backend on Mesa's
# lavapipe (llvmpipe), a Vulkan driver that runs on the CPU. It runs the graph every GPU backend
# runs (device buffers, one upload and one download per step, the scheduler) and shows what the CPU
# cannot: ggml-vulkan reads some operands from the aligned-down start of a view (a ROPE fed block
# positions at an 8-byte offset would rotate by the wrong positions, which is why drafter.cpp puts the
# block's rows first, so its positions start at offset 0).
#
#   scripts/vulkan_check.sh      # after `make test` (reuses .venv's test dependencies); Debian/Ubuntu
#
# Installs the Vulkan packages (apt, root or sudo), builds llama-cpp-python 0.3.36 with -DGGML_VULKAN=on
# (the wheel is cached under ~/.cache/dflash-gguf), installs it and our extension into .venv-vulkan, then
# runs the draft-graph parity tests with the drafter on Vulkan0 and a drafted loop there.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
CACHE_ROOT="${DFLASH_CACHE:-$HOME/.cache/dflash-gguf}"
WHEELS="$CACHE_ROOT/vulkan-$VERSION"
VENV=.venv-vulkan
[[ -x .venv/bin/python ]] || { echo "vulkan_check: run 'make test' first (it makes .venv)" >&2; exit 1; }
export GGML_VK_VISIBLE_DEVICES=0  # ggml-vulkan leaves CPU-type devices such as lavapipe out unless named

# 1. the driver, the loader and the shader compiler
pkgs=(mesa-vulkan-drivers libvulkan-dev glslc spirv-headers)
if ! dpkg -s "${pkgs[@]}" > /dev/null 2>&1; then
    sudo=(); [[ "$(id -u)" == 0 ]] || sudo=(sudo)
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get install -y -q "${pkgs[@]}" > /dev/null \
        || { "${sudo[@]}" apt-get update -q > /dev/null && "${sudo[@]}" apt-get install -y -q "${pkgs[@]}" > /dev/null; }
fi

# 2. llama-cpp-python with Vulkan, built once
wheel="$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl 2> /dev/null | head -1 || true)"
if [[ -z "$wheel" ]]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    sdist="$CACHE_ROOT/llama-server-$VERSION/llama_cpp_python-$VERSION.tar.gz"  # left by `make llama-server`
    if [[ ! -f "$sdist" ]]; then
        .venv/bin/python -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$tmp"
        sdist="$tmp/llama_cpp_python-$VERSION.tar.gz"
    fi
    tar xzf "$sdist" -C "$tmp"
    src="$tmp/llama_cpp_python-$VERSION"
    # ggml-vulkan asks for VK_EXT_layer_settings (validation-layer options only); headers older than
    # 1.3.261 (Debian 12 has 1.3.239) lack it: build without that request
    if ! grep -q VK_EXT_layer_settings /usr/include/vulkan/vulkan_core.h; then
        .venv/bin/python - "$src/vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
pattern = (r"    VkBool32 enable_best_practice = layer_settings;\n.*?"
           r"(    vk::InstanceCreateInfo instance_create_info\(vk::InstanceCreateFlags\{\}, &app_info, layers, extensions)"
           r", &layer_setting_info\);")
text, n = re.subn(pattern, r"\1);", text, count=1, flags=re.S)
if n != 1:
    sys.exit(f"{path}: the VK_EXT_layer_settings block was not found; build with Vulkan headers >= 1.3.261")
open(path, "w").write(text)
PY
    fi
    mkdir -p "$WHEELS"
    echo "building llama-cpp-python $VERSION with Vulkan (about 7 minutes on 2 cores)" >&2
    CMAKE_ARGS="-DGGML_VULKAN=on -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        .venv/bin/python -m pip wheel -q --no-deps -w "$tmp/whl" "$src" > "$tmp/build.log" 2>&1 \
        || { tail -40 "$tmp/build.log" >&2; exit 1; }
    mv "$tmp"/whl/llama_cpp_python-*.whl "$WHEELS/"
    wheel="$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl | head -1)"
fi

# 3. a venv of its own for that libllama and our extension built against it; everything else
#    (numpy, torch, pytest, ...) is .venv's, found through a .pth line after this venv's own packages
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/zz_dflash_main_venv.pth"
"$VENV/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel"
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -C build-dir=build/vulkan \
    -C cmake.define.pybind11_DIR="$(.venv/bin/python -m pybind11 --cmakedir)" .
"$VENV/bin/python" - <<'PY'
import re
import dflash_gguf  # noqa: F401
maps = open("/proc/self/maps").read()
assert "libggml-vulkan.so" in maps, "the Vulkan build of ggml is not the one loaded"
print("ggml libraries:", sorted(set(re.findall(r"lib(?:ggml[-\w]*|llama)\.so", maps))))
PY

# 4. the checks (about 4 minutes: lavapipe takes 0.1-0.25 s per draft step)
DFLASH_TEST_DEVICE=Vulkan0 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_graph_parity.py tests/test_device_loop.py
