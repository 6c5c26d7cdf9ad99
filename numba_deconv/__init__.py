"""numba_deconv: ConvTranspose3d -> BatchNorm3d -> subtract spatial mean, as Numba CUDA kernels.

Importing the package (1) restores what numba-cuda needs from numpy (``compat``), (2) picks the
real GPU or Numba's CUDA simulator before numba is imported (``backend``), and (3) under the
simulator installs the warp intrinsics it lacks (``simulator``). Nothing touches a device here.

    import numba_deconv as nd
    pipe = nd.Pipeline.from_torch(model)
    y = pipe(x)
"""

from . import compat

compat.apply()

from . import backend  # noqa: E402  (must run before numba is imported)

BACKEND = backend.select()

from . import simulator  # noqa: E402

if simulator.is_simulator():
    simulator.install()

from . import folding, geometry, reference  # noqa: E402
from .geometry import ConvGeometry  # noqa: E402
from .backend import tensor_device  # noqa: E402
from .module import ModelNew, convert_sync  # noqa: E402
from .pipeline import Pipeline  # noqa: E402

__all__ = ["BACKEND", "ConvGeometry", "ModelNew", "Pipeline", "convert_sync", "folding",
           "geometry", "reference", "tensor_device"]
__version__ = "0.1.0"
