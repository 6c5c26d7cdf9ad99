#!/usr/bin/env bash
# The whole test suite: the `ci` profile under the CUDA simulator when no GPU is visible, the `gpu`
# profile on a GPU. Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
# -n auto: tests/conftest.py picks the workers (the CPU's cores under the simulator, none on a
# GPU); worksteal: a worker that runs out takes tests queued for the other
exec python -m pytest -p no:cacheprovider -n auto --dist worksteal "$@"
