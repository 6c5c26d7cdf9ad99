"""Choose between a real GPU and Numba's CUDA simulator, before numba is imported.

Numba reads ``NUMBA_ENABLE_CUDASIM`` once, when ``numba.cuda`` is first imported, so the choice
has to be made before that. ``NUMBA_DECONV_DEVICE`` forces it:

* ``gpu`` - use the real device (numba fails loudly if there is none);
* ``sim`` - run every kernel under the simulator (one Python thread per CUDA thread);
* unset or ``auto`` - the simulator when no CUDA device is visible, the GPU otherwise.

An explicit ``NUMBA_ENABLE_CUDASIM`` set by the user always wins.
"""

from __future__ import annotations

import os
import sys

_ENV = "NUMBA_DECONV_DEVICE"


def _gpu_visible() -> bool:
    # torch is a hard dependency and answers without creating a CUDA context in numba.
    import torch

    return bool(torch.cuda.is_available())


def select() -> str:
    """Set up the environment for the chosen backend and return ``"gpu"`` or ``"sim"``."""
    if "NUMBA_ENABLE_CUDASIM" in os.environ:
        return "sim" if os.environ["NUMBA_ENABLE_CUDASIM"] not in ("", "0") else "gpu"
    choice = os.environ.get(_ENV, "auto").strip().lower()
    if choice not in ("auto", "gpu", "sim"):
        raise ValueError(f"{_ENV} must be 'auto', 'gpu' or 'sim', got {choice!r}")
    if choice == "auto":
        choice = "gpu" if _gpu_visible() else "sim"
    if choice == "sim":
        if "numba.cuda" in sys.modules:
            raise RuntimeError(
                "numba.cuda was imported before numba_deconv chose the CUDA simulator; "
                "import numba_deconv first or set NUMBA_ENABLE_CUDASIM=1 yourself"
            )
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        config = sys.modules.get("numba.core.config")
        if config is not None:  # numba itself is loaded (not numba.cuda): update its reading
            config.ENABLE_CUDASIM = 1
    return choice


def tensor_device():
    """Where the pipeline's tensors live (``numba_deconv.tensor_device``): the current CUDA
    device, or the CPU under the simulator."""
    import torch

    if BACKEND_IS_SIMULATOR is None:
        _remember_backend()
    if BACKEND_IS_SIMULATOR:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


#: Whether numba.cuda is the simulator, read once (``simulator.is_simulator``) by the first
#: ``tensor_device`` call: numba.cuda must not be imported before ``select`` has run.
BACKEND_IS_SIMULATOR: bool | None = None


def _remember_backend() -> None:
    global BACKEND_IS_SIMULATOR
    from .simulator import is_simulator

    BACKEND_IS_SIMULATOR = is_simulator()
