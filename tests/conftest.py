"""Test profiles: ``ci`` (CUDA simulator, tiny shapes) and ``gpu`` (real device, larger, many examples).

The profile follows the backend ``numba_deconv`` selects before numba is imported (simulator when
no GPU is visible, or as forced by ``NUMBA_DECONV_DEVICE=sim|gpu``); ``NUMBA_DECONV_PROFILE``
overrides the hypothesis profile. GPU-only checks carry ``@pytest.mark.gpu`` and are skipped, with
that reason, under the simulator; simulator-only checks carry ``@pytest.mark.sim``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

import numba_deconv  # noqa: F401  (selects the backend before anything imports numba.cuda)
from numba_deconv import testing
from numba_deconv.simulator import is_simulator

SIM = is_simulator()

# NUMBA_DECONV_SHARDS=k splits every property that runs kernels (a hypothesis test using the
# ``device`` fixture) into k test items of ceil(examples / k) examples each, every one drawing
# its own random examples, so that pytest-xdist's workers share one property's examples (a
# property with a max_examples of its own is not split, unless that equals the share: the
# settings hold values, not where they came from). On a GPU an example is bound by
# compiling the kernels of its drawn geometry, on one CPU core per process, and the gpu profile
# has fewer such properties than the host has cores (tests/test_shards.py).
_SHARDS = os.environ.get("NUMBA_DECONV_SHARDS", "1")
if not _SHARDS.isdigit() or int(_SHARDS) < 1:
    raise ValueError(f"NUMBA_DECONV_SHARDS must be a positive integer, got {_SHARDS!r}")
SHARDS = int(_SHARDS)


def _per_shard(examples: int) -> int:
    return -(-examples // SHARDS)


# Shards draw random examples even where hypothesis would derandomize them (it does when it
# finds a CI variable such as CI=true): derandomized, every shard of a property draws the same.
_SHARD_DRAWS = {"derandomize": False} if SHARDS > 1 else {}
# ci: 6 examples a property, the same ones every run (hypothesis derandomizes under CI=true;
# every example runs its kernels under the simulator, seconds each); the gpu profile draws
# NUMBA_DECONV_EXAMPLES at random, 300 by default
settings.register_profile(
    "ci", max_examples=_per_shard(6), deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], **_SHARD_DRAWS)
settings.register_profile(
    "gpu", max_examples=_per_shard(int(os.environ.get("NUMBA_DECONV_EXAMPLES", "300"))),
    deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], **_SHARD_DRAWS)
PROFILE = os.environ.get("NUMBA_DECONV_PROFILE", "ci" if SIM else "gpu")
settings.load_profile(PROFILE)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: no error where it is absent
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (scripts/test.sh): under the simulator, which runs kernels in Python and is
    CPU-bound, one worker per core (CI's two cores halve its time); on a GPU one process (0: no
    workers), so that timing checks do not share the device."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own reading of it
    if not SIM:
        return 0
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may use (containers)
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def pytest_report_header(config):
    return f"numba_deconv backend: {'CUDA simulator' if SIM else 'GPU'}; hypothesis profile: {PROFILE}"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a real GPU (running under the CUDA simulator)")
    skip_sim = pytest.mark.skip(reason="simulator-only check (running on a real GPU)")
    for item in items:
        if SIM and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if not SIM and "sim" in item.keywords:
            item.add_marker(skip_sim)


def pytest_configure(config):
    if SHARDS > 1 and config.getoption("hypothesis_seed", None) is not None:
        raise pytest.UsageError(
            "NUMBA_DECONV_SHARDS: with --hypothesis-seed every shard would draw the same "
            "examples; give one or the other")


def pytest_generate_tests(metafunc):
    """The shards of ``NUMBA_DECONV_SHARDS`` (above): one item per shard of each property."""
    # the settings hypothesis attached to the test (no public accessor; without it, no split)
    own = getattr(metafunc.function, "_hypothesis_internal_use_settings", None)
    follows_profile = own is not None and own.max_examples == settings.default.max_examples
    if SHARDS > 1 and follows_profile and "device" in metafunc.fixturenames:
        metafunc.parametrize("shard", range(SHARDS), ids=lambda k: f"shard{k}", indirect=True)


@pytest.fixture(scope="session", autouse=True)
def shard(request) -> int:
    """This item's shard of a property (0 without ``NUMBA_DECONV_SHARDS``): only its test id
    and its random examples differ."""
    return getattr(request, "param", 0)


@pytest.fixture(scope="session")
def limits() -> testing.Limits:
    """Shape limits of drawn cases for this profile."""
    return testing.CI_LIMITS if PROFILE == "ci" else testing.GPU_LIMITS


@pytest.fixture(scope="session")
def device():
    from numba_deconv import tensor_device

    return tensor_device()
