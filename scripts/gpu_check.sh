#!/usr/bin/env bash
# The CUDA checks, run on a GPU machine with no network (the device tool of
# this workplace): builds llama-cpp-python 0.3.36 with CUDA from a trimmed copy
# of its sdist (.gpu/llama-src.tar.xz, made by hand: the sdist minus models/,
# docs/, non-CUDA GPU backends), builds our extension against it, then runs
# the draft-graph parity tests and the benchmarks on CUDA. Logs go to $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
SITE=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpu/whl/*.whl || exit 1
export PYTHONPATH="$SITE"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)
tar xJf .gpu/llama-src.tar.xz -C /tmp
CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON" \
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" /tmp/llama-src \
  > "$OUT/build_llama.log" 2>&1 || { tail -40 "$OUT/build_llama.log"; exit 1; }
t1=$(date +%s); echo "llama-cpp-python CUDA build: $((t1 - t0)) s"
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$SITE" . > "$OUT/build_ours.log" 2>&1 \
  || { tail -40 "$OUT/build_ours.log"; exit 1; }
echo "our build: $(( $(date +%s) - t1 )) s"
python3 - <<'PY' 2>&1 | tee "$OUT/devices.txt"
import llama_cpp, dflash_gguf, re
maps = open('/proc/self/maps').read()
print(sorted(set(re.findall(r'lib(?:ggml-base|llama|ggml-cuda)\.so[.\d]*', maps))))
PY
mkdir -p /tmp/g
python3 -m dflash_convert examples/tinycode/drafter-dflash2 --target examples/tinycode/target-f16.gguf \
  --outfile /tmp/g/tinycode-f32.gguf --outtype f32 > /dev/null || exit 1
python3 -m dflash_convert examples/tinycode/drafter-dflash2 --target examples/tinycode/target-f16.gguf \
  --outfile /tmp/g/tinycode-q8_0.gguf --outtype q8_0 > /dev/null || exit 1
if [[ "${PARITY:-1}" == 1 ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_graph_parity.py 2>&1 | tee "$OUT/parity.txt" | tail -5
fi
for ngl in 99 0; do
  for nmax in auto 7; do
    timeout 120 python3 scripts/bench_generate.py --draft /tmp/g/tinycode-f32.gguf --n-gpu-layers $ngl --threads 4 \
      --n-max $nmax 2>&1 | tee "$OUT/bench_generate_ngl${ngl}_$nmax.txt" | tail -8
  done
done
