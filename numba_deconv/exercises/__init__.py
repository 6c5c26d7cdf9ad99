"""Teaching kernels for the notebooks (``notebooks/04_warp_shuffle``) and exercise solutions.

* ``warp_demo``  - instrumented reductions: a warp sum that records every ``shfl_down`` step, a
                   shared-memory tree that records every level, and three ways to sum an array
                   (warp shuffles, shared-memory tree, one atomic per element) for timing.
* ``solutions``  - solutions of the exercises at the end of notebook 04 (xor butterfly warp sum,
                   warp max), checked against numpy in ``tests/test_exercises.py``.

Nothing here is used by the pipeline; the production reductions live in ``kernels.warp``.
"""
