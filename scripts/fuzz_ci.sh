#!/usr/bin/env bash
# Bounded fuzz run of the drafter GGUF loader, for CI.
#
#   scripts/fuzz_ci.sh              # seeds + FUZZ_TIME (default 120) seconds of fuzzing
#   FUZZ_ASAN=1 scripts/fuzz_ci.sh  # the same against the ASan/UBSan _core (run scripts/asan_check.sh first)
#
# 1. builds the seed corpus (fuzz/make_seeds.py: the bundled drafter in every outtype,
#    small DFlash1/DFlash2 files) and checks every seed loads;
# 2. replays fuzz/regressions/ (every input that ever crashed or misbehaved);
# 3. fuzzes for FUZZ_TIME seconds (fuzz/fuzz_loader.py), then checks for leaks.
# Exits nonzero on any crash, abort, sanitizer report, hang, non-DFlashError exception or
# leak; the offending inputs are in $FUZZ_OUT (default out/fuzz): add each to fuzz/regressions/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
FUZZ_TIME=${FUZZ_TIME:-120}
OUT=${FUZZ_OUT:-out/fuzz}
SEEDS=$OUT/seeds

rm -rf "$OUT" && mkdir -p "$OUT"
echo "[fuzz_ci] seeds -> $SEEDS"
DFLASH_CONVERT_THREADS=1 "$PY" fuzz/make_seeds.py "$SEEDS"

if [ "${FUZZ_ASAN:-0}" = 1 ]; then
  [ -d build/asan/pkg/dflash_gguf ] || { echo "[fuzz_ci] FUZZ_ASAN=1: run scripts/asan_check.sh first (builds build/asan/pkg)"; exit 2; }
  export PYTHONPATH="$PWD/build/asan/pkg${PYTHONPATH:+:$PYTHONPATH}"
  export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:halt_on_error=1:abort_on_error=1:allocator_may_return_null=1:detect_odr_violation=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
  "$PY" -c 'import dflash_gguf; f = dflash_gguf._core.__file__; print("[fuzz_ci] ASan _core:", f); assert "/build/asan/" in f'
fi

echo "[fuzz_ci] replaying fuzz/regressions/"
"$PY" fuzz/fuzz_loader.py --replay fuzz/regressions/*.gguf
cp fuzz/regressions/*.gguf "$SEEDS/"   # known-bad inputs seed the search too

echo "[fuzz_ci] fuzzing for ${FUZZ_TIME} s"
# the fuzzer bounds itself (hangs: --hang-s); the outer timeout is a backstop
timeout --signal=KILL $((FUZZ_TIME + 600)) \
  "$PY" fuzz/fuzz_loader.py --seeds "$SEEDS" --time "$FUZZ_TIME" --crashes "$OUT/findings"
echo "[fuzz_ci] ok: $OUT/findings/summary.json"
