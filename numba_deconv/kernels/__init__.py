"""``@cuda.jit`` kernels, one file per idea, each with its launcher.

* ``warp``          - warp- and block-level reductions built on ``shfl_down_sync`` (shared by all).
* ``scatter``       - transposed convolution, one thread per input voxel, atomics into the output.
* ``gather``        - transposed convolution split into stride**3 dense phase classes, register
                      tiles, fused BN/mean epilogue: the fast path.
* ``box_sums``      - per-tap input box sums, giving the output's spatial mean before the conv.
* ``gram``          - the input's Gram sums per cell and their fixed-order reduction, contracted
                      with the weights: training's batch variance before the convolution.
* ``spatial_reduce``- per-(n, c) mean and centred sum of squares of a stored tensor (warp shuffles).
* ``epilogue``      - elementwise ``out = scale_c * (y - mean_nc)``, in-place channel scaling and
                      channel fills.
* ``batch_stats``   - training's per-channel finish: batch statistics, scale, running-stat update.
* ``async_copy``    - global-to-shared copies that hold no register (``cp.async``): the gather's
                      weight staging, ``gram_sums``' tiles.
* ``vecload``       - four float32 values in one 16-byte global load (``box_sums``' quads).
* ``fastdiv``       - division by a run-time constant as a multiply-high (block index splits).
* ``griddep``       - programmatic dependent launch: a kernel starts while the one before it
                      finishes and waits for it only where it reads its results (Hopper).
* ``ptx``           - what ``async_copy`` and ``griddep`` share: the device's capability,
                      operand-free PTX intrinsics.
* ``mma``           - tensor-core multiply-accumulate (``mma.sync``, TF32 m16n8k8) and TF32
                      rounding from inline PTX, with the simulator's stand-ins.
* ``gather_mma``    - the gather's phase classes as implicit GEMMs on TF32 tensor cores, with the
                      gather's epilogues (``Pipeline(precision="tf32")``).
* ``half``          - half-precision outputs stored rounded and incoming gradients loaded, through
                      ``uint16`` views, by the float32 kernels (``Pipeline.half_call``).
* ``launch``        - how a kernel is launched: tensors as arguments, torch's stream, the direct
                      path past numba's dispatcher, recorded calls replayed, and what differs
                      under the simulator.
* ``disk_cache``    - compiled kernels kept on disk across processes, and their keys.

The math behind them is in docs/design.md.
"""
