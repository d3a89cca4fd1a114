#!/usr/bin/env bash
# The CUDA checks, run on a GPU machine with no network (the device tool of this workplace), within one
# time budget (GPU_CHECK_BUDGET seconds, default 560: the tool allows 600 s per command and one lease
# rarely fits two). Most important first:
#   1. llama-cpp-python 0.3.36 with CUDA: built off the device by scripts/build_cuda_prebuilt.sh
#      (.gpu/prebuilt/llama-cpp-python-cuda.tar.xz, seconds to unpack), else, or where that build does not
#      load or sees no GPU, built here from .gpu/llama-src.tar.xz (~320 s); our extension against it (~30 s)
#      (scripts/make_gpu_bundle.sh makes .gpu/);
#   2. in the background: the inflated pairs of step 4, in its order (`dflash bench --scale`'s files), and
#      llama-server from the same build tree unless it was prebuilt too;
#   3. the draft-graph parity tests on CUDA, each test in a pytest-xdist worker so that a crash names its
#      test; if one crashed, which library serves libllama's libstdc++ calls;
#   4. `dflash bench --scale` end to end on CUDA at n_max 3, 7, auto: 4B F16, 8B F16, the Qwen3.5-style
#      2.8B-hybrid F16, the Qwen3-30B-A3B-style 4.5B-moe F16, 4B Q4_K_M, 8B Q4_K_M, the Qwen3.5-35B-A3B-style
#      7B-hybrid-moe F16, 4.5B-moe F16 with its experts in RAM (--cpu-moe),
#      one run (and one JSON) each, as far as the budget goes (with libstdc++ preloaded if only that let a
#      model load in 3);
#   5. scripts/trace_auto.py at 4B F16, if time is left.
# The tool returns at most 8 files from $OUT: run it as
#   bash scripts/gpu_check.sh 2>&1 | tee $OUT/all.txt
# (all.txt holds every table). Carry .gpu. For a lease's remainder, a shorter run:
#   GPU_CHECK_BUDGET=215 GPU_CHECK_RUNS=8B:f16 GPU_CHECK_NMAX=7,auto GPU_CHECK_PARITY_S=45 bash scripts/gpu_check.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
LOGS=/tmp/gpu_logs; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
SITE=/tmp/site
LLB=/tmp/llbuild  # kept, so that llama-server builds on the same objects
SCALE=/tmp/scale
export DFLASH_TINYCODE="$PWD/examples/tinycode"  # what --scale inflates (the installed package has no examples/)
T0=$(date +%s)
DEADLINE=$((T0 + ${GPU_CHECK_BUDGET:-560}))
# seconds a step may take: its own limit, cut to what the budget has left
budget() {
  local left=$((DEADLINE - $(date +%s)))
  ((left < 1)) && left=1
  ((left < $1)) && echo "$left" || echo "$1"
}
stamp() { echo "== [$(($(date +%s) - T0)) s] $*"; }

python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpu/whl/*.whl || exit 1
export PYTHONPATH="$SITE"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
PREBUILT=.gpu/prebuilt/llama-cpp-python-cuda.tar.xz  # scripts/build_cuda_prebuilt.sh: built off the device
if [[ -f "$PREBUILT" ]]; then
  stamp "unpack the prebuilt llama-cpp-python (CUDA) and llama-server"
  PRE=/tmp/prebuilt; rm -rf "$PRE"; mkdir -p "$PRE"
  tar xJf "$PREBUILT" -C "$PRE" || exit 1
  CUDA_LIB="$PRE/llama_cpp/lib/libggml-cuda.so"
  # built elsewhere, its RUNPATH holds no folder of this machine's CUDA libraries: find the ones it needs
  for lib in $(readelf -d "$CUDA_LIB" | grep -oE 'lib(cudart|cublas)\.so\.[0-9]+'); do
    ldconfig -p | grep -q "$lib " && continue
    found=$(find /usr/local /opt /usr/lib -name "$lib" 2>/dev/null | head -1)
    [[ -n "$found" ]] && export LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  # used only if every library it needs is found and libllama sees a GPU through it
  missing=$(ldd "$CUDA_LIB" 2>&1 | grep -E "not found|No such file")
  gpu=$(PYTHONPATH="$PRE:$SITE" timeout 60 python3 -c "import llama_cpp; print(llama_cpp.llama_supports_gpu_offload())" 2>&1 | tail -1)
  if [[ -z "$missing" && "$gpu" == True ]]; then
    cp -a "$PRE/." "$SITE/"
  else
    echo "the prebuilt build is not used: ${missing:-no library missing}; GPU offload: $gpu"
  fi
  rm -rf "$PRE"
fi
if [[ ! -d "$SITE/llama_cpp" ]]; then
  stamp "build llama-cpp-python (CUDA, sm_90)"
  tar xJf .gpu/llama-src.tar.xz -C /tmp
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON" \
    timeout "$(budget 400)" python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" \
    -C build-dir="$LLB" /tmp/llama-src > "$LOGS/build_llama.log" 2>&1 || { tail -40 "$LOGS/build_llama.log"; exit 1; }
fi
stamp "build ours"
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" . > "$LOGS/build_ours.log" 2>&1 \
  || { tail -40 "$LOGS/build_ours.log"; exit 1; }
python3 - <<'PY' 2>&1
import llama_cpp, dflash_gguf, re
maps = open('/proc/self/maps').read()
print(sorted(set(re.findall(r'lib(?:ggml-base|ggml|llama|ggml-cuda)\.so[.\d]*', maps))))
PY

if [[ -x "$SITE/llama-server-bin/llama-server" ]]; then
  stamp "background: inflated pairs (llama-server prebuilt)"
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
    "$SITE/llama-server-bin:$SITE/llama_cpp/lib:$SITE/lib" "$SITE/llama-server-bin/llama-server" > /tmp/llama-server
  chmod +x /tmp/llama-server
  SERVER_PID=
else
  stamp "background: llama-server build, inflated pairs"
  ( cmake -S /tmp/llama-src -B "$LLB" -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$LOGS/server_configure.log" 2>&1 \
    && cmake --build "$LLB" --target llama-server -j "$(nproc)" > "$LOGS/server_build.log" 2>&1 ) &
  SERVER_PID=$!
fi
# the --scale runs, most important first; each pair's files are made in this order and announced in
# $SCALE/ready-<size>-<type> when complete
# (size:type, or size:type:flag for the target's placement: 4.5B-moe's experts in RAM, as on a small GPU)
RUNS=(${GPU_CHECK_RUNS:-4B:f16 8B:f16 2.8B-hybrid:f16 4.5B-moe:f16 4B:q4_k_m 8B:q4_k_m 7B-hybrid-moe:f16 4.5B-moe:f16:--cpu-moe})
mkdir -p "$SCALE"
python3 - "$SCALE" "${RUNS[@]}" > "$LOGS/pairs.log" 2>&1 <<'PY' &
import sys, time
from pathlib import Path
from dflash_gguf.bench.inflate import SIZES, ensure_pair
folder = Path(sys.argv[1])
for size, t in (run.split(":")[:2] for run in sys.argv[2:]):
    t0 = time.perf_counter()
    ensure_pair(SIZES[size], folder, target_types=(t,), log=print)
    (folder / f"ready-{size}-{t}").touch()
    print(f"{size} {t}: {time.perf_counter() - t0:.0f} s", flush=True)
PY
PAIRS_PID=$!

stamp "parity (CUDA), one xdist worker per test"
DFLASH_TEST_DEVICE=CUDA0 timeout "$(budget ${GPU_CHECK_PARITY_S:-90})" python3 -m pytest -q -n 4 --tb=line -p no:cacheprovider \
  tests/test_graph_parity.py tests/test_device_loop.py > "$OUT/parity.txt" 2>&1
grep -E "passed|failed|crashed|^E |Error" "$OUT/parity.txt" | tail -30

# In a build made on the device, test_device_loop crashed (SIGSEGV) in its first llama_cpp model load after
# torch's import: llama_model::print_info's `ostream << long` ran std::ostream::_M_insert<long> from
# libggml-cuda.so, not libstdc++ (dflash_gguf now puts libstdc++ first, docs/reliability.md). If a test
# crashes again: where libllama's lookup goes, and whether LD_PRELOAD or torch's import changes it.
BENCH_PRELOAD=
if grep -q "crashed" "$OUT/parity.txt"; then
  stamp "a test crashed: which library serves libllama's std::ostream calls"
  L="$SITE/llama_cpp/lib"
  echo "libllama NEEDED: $(readelf -d "$L/libllama.so" | grep NEEDED | grep -oE '\[[^]]+\]' | tr '\n' ' ')"
  echo "libggml-cuda exports $(nm -D --defined-only "$L/libggml-cuda.so" | grep -c ' _ZN[Ss][toi]') std:: symbols," \
    "$(nm -D --defined-only "$L/libggml-cuda.so" | grep -c ' _ZNSo9_M_insert') of them std::ostream::_M_insert<T>"
  STDCXX=$(ldconfig -p | grep -m1 'libstdc++.so.6 ' | awk '{print $NF}')
  LOAD="llama_cpp.Llama('examples/tinycode/target-f16.gguf', verbose=False)"
  for how in "import llama_cpp" "import torch, llama_cpp" "import dflash_gguf, llama_cpp" "import torch, dflash_gguf, llama_cpp"; do
    rm -f /tmp/ldb.*
    LD_DEBUG=bindings LD_DEBUG_OUTPUT=/tmp/ldb timeout 30 python3 -c "$how; $LOAD" > /dev/null 2>&1
    rc=$?
    LD_PRELOAD="$STDCXX" timeout 30 python3 -c "$how; $LOAD" > /dev/null 2>&1
    rc_pre=$?
    # the bench's own imports: if only the preload loads a model, the --scale runs below get it too
    [[ "$how" == "import dflash_gguf, llama_cpp" && $rc != 0 && $rc_pre == 0 ]] && BENCH_PRELOAD="$STDCXX"
    echo "$how: rc $rc, with LD_PRELOAD=libstdc++ rc $rc_pre;" \
      "libllama's std::ostream calls bound $(grep -h "binding file [^ ]*libllama" /tmp/ldb.* 2>/dev/null \
      | grep "_ZNSo" | grep -oE " to [^ ]+" | sort | uniq -c | tr -s '\n ' ' ')"
  done
  DFLASH_TEST_DEVICE=CUDA0 LD_PRELOAD="$STDCXX" timeout "$(budget 60)" python3 -m pytest -q --tb=line -p no:cacheprovider \
    tests/test_device_loop.py 2>&1 | grep -E "passed|failed|^E " | tail -5
fi

if [[ -n "$SERVER_PID" ]]; then
  stamp "waiting for llama-server"
  if ! timeout "$(budget 200)" tail --pid=$SERVER_PID -f /dev/null; then echo "llama-server build still running"; fi
  SERVER=$(find "$LLB" -name llama-server -type f -perm -u+x | head -1)
  [[ -z "$SERVER" ]] && { echo "no llama-server"; tail -15 "$LOGS/server_configure.log" "$LOGS/server_build.log"; }
else
  SERVER=/tmp/llama-server
  "$SERVER" --version 2>&1 | tail -2
fi
export DFLASH_LLAMA_SERVER="$SERVER"
SYSTEMS=ar,ours${SERVER:+,upstream}

for st in "${RUNS[@]}"; do
  IFS=: read -r size t flag <<< "$st"
  stamp "waiting for the $size $t pair"
  until [[ -e "$SCALE/ready-$size-$t" ]] || ! kill -0 $PAIRS_PID 2>/dev/null || (($(date +%s) >= DEADLINE)); do sleep 2; done
  [[ -e "$SCALE/ready-$size-$t" ]] || { echo "pair not ready"; tail -5 "$LOGS/pairs.log"; break; }
  stamp "dflash bench --scale $size $t $flag (CUDA)"
  LD_PRELOAD="$BENCH_PRELOAD" timeout "$(budget 150)" python3 -m dflash_gguf.cli bench --scale --scale-sizes "$size" --scale-types "$t" \
    --scale-dir "$SCALE" -ngl 99 ${flag:+"$flag"} --threads 4 -n 128 --limit 5 --n-max "${GPU_CHECK_NMAX:-3,7,auto}" --systems "$SYSTEMS" \
    --no-progress --json "$OUT/scale_${size}_$t${flag//-/_}.json" 2>&1 | grep -v "^wrote"
done
# what auto mode chose on CUDA, step by step (it drafted shorter than the best fixed n_max there), if
# the budget leaves time
if [[ -e "$SCALE/ready-4B-f16" ]] && (($(budget 60) >= 60)); then
  stamp "scripts/trace_auto.py at 4B F16 (CUDA)"
  timeout "$(budget 90)" python3 scripts/trace_auto.py --target "$(ls "$SCALE"/4B-*-target-f16.gguf)" \
    --draft "$(ls "$SCALE"/4B-*-dflash2-q4_0-head.gguf)" -ngl 99 --threads 4 --rounds 1 --steps --json "$OUT/trace_auto_4B.json" 2>&1 | tail -40
fi
cat "$LOGS/pairs.log"
stamp "done"
