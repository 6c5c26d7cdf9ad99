#!/usr/bin/env bash
# Everything for a GPU machine without network in one call: the `gpu` test profile, then the
# benchmark. Uses the machine's python3 (torch, numba, numba-cuda, numpy, pytest, hypothesis);
# numba_deconv.compat makes numba-cuda work on numpy 2.5.
#   bash scripts/gpu_check.sh [tests|bench|notebooks|all|profile]   (logs under $OUT or ./out)
# `notebooks` runs each notebook's paired percent-format source with python3 at full size (the GPU
# image has no nbclient; CI executes the .ipynb files under the simulator).
# The gpu profile draws 300 examples per property, and every drawn geometry compiles its kernels
# (~5 s in evaluation, ~15 s in training on a GPU machine's host), many CPU-core-seconds an example,
# so the whole profile takes hours: lower NUMBA_DECONV_EXAMPLES to fit a device call, and spread
# each property over the cores with NUMBA_DECONV_SHARDS and GPU_TEST_ARGS='-n 16'
# (NUMBA_DECONV_SHARDS=8 NUMBA_DECONV_EXAMPLES=16 runs the whole suite in 4-6 min on 16 cores),
# or run it in pieces with `profile`:
# `profile` runs the profile's properties in one device call of bounded length, to be repeated
# until each has drawn its 300 examples in all (every piece draws new random examples); then
#   python benchmarks/count_examples.py <every piece's gpu_props.log and gpu_cheap.log>
# adds each property's passing and failing examples up. The properties without
# geometry-dependent kernels (batch statistics, fast division, the Gram plan, launch arguments,
# geometry) run whole on two cores, at the profile's full count whatever NUMBA_DECONV_EXAMPLES
# says. The pipeline's properties run on the other cores (WORKERS, 14) in NUMBA_DECONV_SHARDS
# (16) shards of NUMBA_DECONV_EXAMPLES (80) / shards examples until SECONDS_LIMIT (540), when
# pytest is interrupted and prints the statistics of the shards that finished (an interrupted
# shard prints none: its examples are not counted); PROPERTIES (a pytest -k expression) narrows
# them to those still short of their count. Its exit status is count_examples.py's: 1 when any
# example failed. One call draws ~30-50 examples of each pipeline property on an H100 machine's
# 16 cores.
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
    python3 -m numba_deconv bench --suite --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
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
if [ "$WHAT" = profile ]; then
    PYTEST=(python3 -m pytest -p no:cacheprovider -p no:benchmark -rfE --hypothesis-show-statistics)
    sha1sum numba_deconv/*.py numba_deconv/kernels/*.py tests/*.py > "$OUT/sha1sums.txt"
    CHEAP=(tests/test_batch_stats.py tests/test_fastdiv.py tests/test_launch_args.py
           tests/test_geometry.py tests/test_gram.py::test_plan_gives_pytorchs_sum_of_squares)
    ( env -u NUMBA_DECONV_EXAMPLES -u NUMBA_DECONV_SHARDS timeout -s INT "${SECONDS_LIMIT:-540}" \
          "${PYTEST[@]}" -n 2 "${CHEAP[@]}" > "$OUT/gpu_cheap.log" 2>&1
      echo "pytest rc $?" >> "$OUT/gpu_cheap.log" ) &
    NUMBA_DECONV_SHARDS="${NUMBA_DECONV_SHARDS:-16}" \
        NUMBA_DECONV_EXAMPLES="${NUMBA_DECONV_EXAMPLES:-80}" \
        timeout -s INT "${SECONDS_LIMIT:-540}" "${PYTEST[@]}" -n "${WORKERS:-14}" \
        --dist worksteal ${PROPERTIES:+-k "$PROPERTIES"} tests/test_pipeline_properties.py \
        > "$OUT/gpu_props.log" 2>&1
    echo "pytest rc $?" >> "$OUT/gpu_props.log"
    wait
    head -8 "$OUT/gpu_props.log"
    tail -n 3 "$OUT/gpu_props.log" "$OUT/gpu_cheap.log"
    python3 benchmarks/count_examples.py "$OUT/gpu_props.log" "$OUT/gpu_cheap.log"
    status=$?
fi
exit $status
