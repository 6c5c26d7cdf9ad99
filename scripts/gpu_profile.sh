#!/usr/bin/env bash
# The gpu test profile's properties in one device call of bounded length, to be repeated until
# every property has drawn its 300 examples in all (each call draws new random examples):
#   bash scripts/gpu_profile.sh            (logs under $OUT or ./out)
#   python benchmarks/count_examples.py <every call's gpu_props.log and gpu_cheap.log>
# The properties without geometry-dependent kernels (batch statistics, fast division, the
# Gram plan, launch arguments, geometry) run whole on two cores, at the profile's full count
# whatever NUMBA_DECONV_EXAMPLES says. The pipeline's properties, which compile the kernels of
# every drawn geometry (~25 CPU-core-seconds an example on an H100's host, session 22), run on
# the other cores in NUMBA_DECONV_SHARDS shards of NUMBA_DECONV_EXAMPLES / shards examples
# until SECONDS_LIMIT, when pytest is interrupted and prints the statistics of the shards that
# finished; PROPERTIES (a pytest -k expression) narrows them to those still short of their
# count. The exit status is count_examples.py's: 1 when any example failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NUMBA_DECONV_DEVICE=gpu
SECONDS_LIMIT="${SECONDS_LIMIT:-540}"
WORKERS="${WORKERS:-14}"
PYTEST=(python3 -m pytest -p no:cacheprovider -p no:benchmark -rfE --hypothesis-show-statistics)
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/device.txt"
sha1sum numba_deconv/*.py numba_deconv/kernels/*.py tests/*.py > "$OUT/sha1sums.txt"
CHEAP=(tests/test_batch_stats.py tests/test_fastdiv.py tests/test_launch_args.py
       tests/test_geometry.py tests/test_gram.py::test_plan_gives_pytorchs_sum_of_squares)
( env -u NUMBA_DECONV_EXAMPLES -u NUMBA_DECONV_SHARDS \
      timeout -s INT "$SECONDS_LIMIT" "${PYTEST[@]}" -n 2 "${CHEAP[@]}" > "$OUT/gpu_cheap.log" 2>&1
  echo "pytest rc $?" >> "$OUT/gpu_cheap.log" ) &
export NUMBA_DECONV_SHARDS="${NUMBA_DECONV_SHARDS:-16}"
export NUMBA_DECONV_EXAMPLES="${NUMBA_DECONV_EXAMPLES:-80}"
timeout -s INT "$SECONDS_LIMIT" "${PYTEST[@]}" -n "$WORKERS" --dist worksteal \
    ${PROPERTIES:+-k "$PROPERTIES"} tests/test_pipeline_properties.py > "$OUT/gpu_props.log" 2>&1
echo "pytest rc $?" >> "$OUT/gpu_props.log"
wait
head -8 "$OUT/gpu_props.log"
tail -n 3 "$OUT/gpu_props.log" "$OUT/gpu_cheap.log"
python3 benchmarks/count_examples.py "$OUT/gpu_props.log" "$OUT/gpu_cheap.log"
