#!/usr/bin/env bash
# The whole test suite: the `ci` profile under the CUDA simulator when no GPU is visible, the `gpu`
# profile on a GPU. Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec python -m pytest -p no:cacheprovider "$@"
