#!/usr/bin/env bash
# Everything for the lent GPU machine in one call (no network there, no wheels to carry): the `gpu`
# test profile, then the benchmark. Uses the image's python3 (torch, numba, numba-cuda, numpy 2.5,
# pytest, hypothesis); numba_deconv.compat makes numba-cuda work on numpy 2.5.
#   bash scripts/gpu_check.sh [tests|bench|notebooks|all]   (logs and results under $OUT or ./out)
# `notebooks` runs each notebook's paired percent-format source with python3 at full size (the GPU
# image has no nbclient; CI executes the .ipynb files under the simulator).
# The gpu profile draws 300 examples per property, and every drawn geometry compiles its kernels
# (~5 s in evaluation, ~20-45 s in training on an H100's host, session 22), ~25 CPU-core-seconds
# an example, so the whole profile takes hours: lower NUMBA_DECONV_EXAMPLES to fit a device call,
# and spread each property over the cores with NUMBA_DECONV_SHARDS and GPU_TEST_ARGS='-n 16'
# (NUMBA_DECONV_SHARDS=8 NUMBA_DECONV_EXAMPLES=48 ran 260-380 of tests/test_pipeline_properties.py's
# examples in 9.5 min on 16 cores; NUMBA_DECONV_EXAMPLES=16 ran the whole suite in 6 min), or
# split it with GPU_TEST_ARGS (e.g. '-k "any_geometry"'); scripts/gpu_profile.sh runs it in
# time-limited pieces whose counts benchmarks/count_examples.py adds up.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NUMBA_DECONV_DEVICE=gpu
WHAT="${1:-all}"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, numba, numpy; from numba_cuda import __version__ as nc; print('torch', torch.__version__, 'numba', numba.__version__, 'numba-cuda', nc, 'numpy', numpy.__version__)" | tee -a "$OUT/device.txt"
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
    python3 -m pytest -p no:cacheprovider -q -x --durations=15 \
        ${GPU_TEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -40
    status=${PIPESTATUS[0]}
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
    python3 -m numba_deconv bench --tiny --geometry --sweep --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$WHAT" = notebooks ] || [ "$WHAT" = all ]; then
    for nb in notebooks/0*.py; do
        start=$(date +%s)
        if (cd notebooks && MPLBACKEND=Agg python3 "$(basename "$nb")") > "$OUT/$(basename "$nb" .py).log" 2>&1; then
            echo "notebook $nb: ok in $(( $(date +%s) - start )) s"
        else
            echo "notebook $nb: FAILED (see $(basename "$nb" .py).log)"; tail -5 "$OUT/$(basename "$nb" .py).log"; status=1
        fi
    done
fi
exit $status
