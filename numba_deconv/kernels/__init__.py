"""``@cuda.jit`` kernels, one file per idea, each with its launcher.

* ``warp``          - warp- and block-level reductions built on ``shfl_down_sync`` (shared by all).
* ``scatter``       - transposed convolution, one thread per input voxel, atomics into the output.
* ``gather``        - transposed convolution split into stride**3 dense phase classes, register
                      tiles, fused BN/mean epilogue: the fast path.
* ``box_sums``      - per-tap input box sums, giving the output's spatial mean before the conv.
* ``spatial_reduce``- per-(n, c) mean and centred sum of squares of a stored tensor (warp shuffles).
* ``epilogue``      - elementwise ``out = scale_c * (y - mean_nc)`` and channel fills.
* ``batch_stats``   - training's per-channel finish: batch statistics, scale, running-stat update.
* ``async_copy``    - global-to-shared copies that hold no register (``cp.async``): the gather's
                      weight staging.
* ``griddep``       - programmatic dependent launch: a kernel starts while the one before it
                      finishes and waits for it only where it reads its results (Hopper).
* ``ptx``           - what those two share: the device's capability, operand-free PTX intrinsics.
* ``launch``        - how a kernel is launched: tensors as arguments, torch's stream, the direct
                      path past numba's dispatcher, and what differs under the simulator.
"""
