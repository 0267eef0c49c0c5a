#!/usr/bin/env bash
# The GPU checks of issue #22 in one call, on a GPU machine without Ray, NIXL or network:
#   1. tests/gpu (engine vs transformers on CUDA, CDSP ring steps on CUDA, CUDA-graph decode,
#      Triton kernels compiled), 2. decode tokens/s vs transformers generate at batch 1/8/32,
#   3. the kernel benchmark at 8k/32k/128k.
# Wheels the machine lacks (msgspec) travel in .whl/; the package installs from this tree.
# Logs and JSON go to $OUT (default /tmp/gpu_checks). Each phase has its own time limit, so a
# slow phase cannot starve the next; a phase can be skipped with SKIP="tests decode kernels",
# DECODE_ARGS passes options to the decode benchmark (e.g. "--shape llama-8b"), KERNEL_ARGS to
# the kernel benchmark (e.g. "--triton-configs 128,64,8,3"), KERNEL_TOKENS its lengths.
#
#     bash benchmarks/gpu_checks.sh
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
SKIP=${SKIP:-}
T_TESTS=${T_TESTS:-240} T_DECODE=${T_DECODE:-150} T_KERNELS=${T_KERNELS:-60}
stamp() { echo "[$(date +%T)] $*"; }

stamp install
rm -rf /tmp/site   # pip --target keeps what is there: a warm machine would run the last call's code
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --no-cache-dir --target /tmp/site . >/tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)" \
  | tee -a "$OUT/device.txt"

if [[ " $SKIP " != *" tests "* ]]; then
  stamp "tests/gpu (limit ${T_TESTS}s)"
  # -P: the source tree's tetris/ must not shadow the installed package (its actors/ etc. are
  # mapped in by pyproject's package-dir)
  timeout "$T_TESTS" python3 -P -m pytest -q -p no:cacheprovider tests/gpu -rA --durations=15 \
    >"$OUT/gpu_tests.log" 2>&1
  echo "exit $?" >>"$OUT/gpu_tests.log"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^exit" "$OUT/gpu_tests.log" | tail -40
fi
if [[ " $SKIP " != *" decode "* ]]; then
  stamp "decode benchmark (limit ${T_DECODE}s)"
  (cd benchmarks && timeout "$T_DECODE" python3 bench_decode_gpu.py ${DECODE_ARGS:-} --json \
    >"$OUT/decode_gpu.json" 2>"$OUT/decode_gpu.err"; echo "exit $?" >>"$OUT/decode_gpu.err")
  tail -6 "$OUT/decode_gpu.err"
fi
if [[ " $SKIP " != *" kernels "* ]]; then
  # one context length per process and line: a length that runs out of time loses only itself
  stamp "kernel benchmark (limit ${T_KERNELS}s per length)"
  for T in ${KERNEL_TOKENS:-8192 32768 131072}; do
    (cd benchmarks && timeout "$T_KERNELS" python3 bench_kernels_gpu.py --tokens "$T" ${KERNEL_ARGS:-} --json \
      >>"$OUT/kernels_gpu.jsonl" 2>>"$OUT/kernels_gpu.err"; echo "T=$T exit $?" >>"$OUT/kernels_gpu.err")
  done
  tail -3 "$OUT/kernels_gpu.err"
  python3 -P -c "import json,sys; sys.path.insert(0,'benchmarks'); import bench_kernels_gpu as b; \
rows=[json.loads(l) for l in open('$OUT/kernels_gpu.jsonl') if l.strip()]; r=rows[0]; \
r['attention']=[x for y in rows for x in y['attention']]; r['decode']=[x for y in rows for x in y['decode']]; \
b.print_table(r)" 2>&1 | tail -12
fi
stamp done
