#!/usr/bin/env bash
# Run the default problem (numba_deconv vs PyTorch, both modes). Extra arguments go to the CLI:
#   bash scripts/run.sh bench --sweep      bash scripts/run.sh explain
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec python -m numba_deconv "$@"
