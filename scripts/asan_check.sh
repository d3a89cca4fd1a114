#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer check of our extension (not of libllama).
#
# Builds _core with -DDFLASH_SANITIZE=ON in build/asan (the installed package is
# left alone), then runs the C++-heavy tests with that _core first on the path:
#   scripts/asan_check.sh [pytest args...]     (default: the subset below)
# Environment: PY (default .venv/bin/python), JOBS (default 1).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
JOBS=${JOBS:-1}
BUILD=$ROOT/build/asan
PYBIND11_DIR=$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')

cmake -S . -B "$BUILD" -G Ninja -DDFLASH_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$PYBIND11_DIR" > "$BUILD.configure.log" 2>&1 \
  || { cat "$BUILD.configure.log"; exit 1; }
cmake --build "$BUILD" --target _core -j "$JOBS"

# a package directory whose _core is the sanitized one and whose Python files are ours
PKG=$BUILD/pkg/dflash_gguf
rm -rf "$BUILD/pkg" && mkdir -p "$PKG"
for f in "$ROOT"/bindings/dflash_gguf/*; do
  case "$(basename "$f")" in _core*.so|__pycache__) ;; *) ln -s "$f" "$PKG/";; esac
done
cp "$BUILD"/_core*.so "$PKG/"
# _core's RUNPATH is $ORIGIN/../llama_cpp/lib: point it at the installed wheel's libraries
LLAMA_PKG=$("$PY" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent)')
ln -s "$LLAMA_PKG" "$BUILD/pkg/llama_cpp"
# an editable install's import hook (scikit-build-core) outranks PYTHONPATH: drop it for dflash_gguf
cat > "$BUILD/pkg/sitecustomize.py" <<'PYEOF'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable_skbc_dflash_gguf")]
PYEOF

# python does not link libstdc++: preload it with libasan, or ASan's __cxa_throw interceptor finds
# no real __cxa_throw and the first C++ exception aborts ("CHECK failed: asan_interceptors.cpp:320")
LIBASAN="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
if [ "$#" -eq 0 ]; then
  set -- tests/test_loader.py tests/test_graph_parity.py tests/test_api.py tests/test_state.py tests/test_sampling.py tests/test_chat_reply.py \
         tests/test_draft_length.py tests/test_share_weights.py tests/test_draft_vocab.py tests/test_reasoning_budget.py tests/test_lora.py tests/test_kv_cache_types.py \
         "tests/test_lossless.py::test_greedy_lossless_bundled" "tests/test_lossless.py::test_rollback_gives_identical_outputs" \
         "tests/test_lossless.py::test_generation_to_a_full_context" tests/test_hardening.py \
         tests/test_arch_targets.py -k "not long_run and not llama_server"
fi
# Python itself leaks at exit, so no leak check here (fuzz_ci.sh checks growth instead);
# halt on the first error so a finding fails the run.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:halt_on_error=1:abort_on_error=1:allocator_may_return_null=1:detect_odr_violation=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
echo "[asan] $(basename "$PKG/"_core*.so) from $BUILD, LD_PRELOAD=$LIBASAN"
PYTHONPATH="$BUILD/pkg:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" LD_PRELOAD="$LIBASAN" DFLASH_ASAN_CHECK=1 \
  "$PY" -c 'import dflash_gguf, sys; f = dflash_gguf._core.__file__; print("[asan] _core:", f); sys.exit(0 if "/build/asan/" in f else 1)'
PYTHONPATH="$BUILD/pkg:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" LD_PRELOAD="$LIBASAN" DFLASH_ASAN_CHECK=1 \
  "$PY" -m pytest -q -p no:cacheprovider "$@"
