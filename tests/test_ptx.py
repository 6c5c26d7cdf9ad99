"""``kernels.ptx``: the capability check the inline-PTX intrinsics compile against."""

from __future__ import annotations

import pytest

from numba_deconv.kernels import ptx


def test_no_device_has_a_capability_from_the_future():
    assert ptx.device_at_least((99, 0)) is False


@pytest.mark.gpu
def test_the_gpu_has_its_own_capability():
    from numba import cuda

    cc = tuple(cuda.get_current_device().compute_capability)
    assert ptx.device_at_least(cc) is True
    assert ptx.device_at_least((cc[0], cc[1] + 1)) is False
