"""Compatibility shims for the library versions we support, applied before numba compiles.

numpy 2.5 removed ``np.row_stack`` (a deprecated alias of ``np.vstack`` since numpy 2.0).
numba-cuda 0.30.4 still references it while lowering the first kernel it compiles, so on
numpy 2.5 every ``@cuda.jit`` compile fails with ``AttributeError: module 'numpy' has no
attribute 'row_stack'``. Upstream closed the report as won't-fix (numba-cuda is in maintenance
mode), and numba itself supports numpy < 2.6, so we restore the alias. It is the same function
numpy used to export under that name, so nothing else can observe the difference.

``apply()`` is idempotent and is called by ``numba_deconv/__init__.py`` before anything imports
``numba.cuda``.
"""

from __future__ import annotations

import numpy as np


def apply() -> None:
    """Install the shims this numpy needs (currently only ``np.row_stack``)."""
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack  # removed in numpy 2.5; numba-cuda 0.30.4 still uses it
