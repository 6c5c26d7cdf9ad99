"""Registers, spills and SASS of a kernel for sm_90 without a GPU.

Answers: does a kernel change keep the register cap without spilling, and what does it do to the
instruction mix? Covers the default problem's gather kernel (``eval``, ``train``: the centred-
square epilogue, ``scaled``: the Gram path's scaled epilogue), the tensor-core gather's
(``mma``, ``mma-train``: the default problem's or another suite row's, ``--row``), ``gram_sums``
(``gram``, the default problem's or a small one's with four teams per slot) and ``box_sums``
(``box``, the default problem's).

    pip install -e '.[sass]'          # libNVVM, NVRTC and ptxas (CUDA 12), nvdisasm
    python benchmarks/offline_sass.py [eval|train|scaled|mma|mma-train] [--out PREFIX]
    python benchmarks/offline_sass.py mma|mma-train [--operand bfloat16|float16|tf32x3]
        [--row decoder_k2s2] [--out PREFIX]
    python benchmarks/offline_sass.py gram [--case default|small] [--dtype float32|float64]
        [--out PREFIX]
    python benchmarks/offline_sass.py box [--dtype float32|float64] [--out PREFIX]

numba compiles the kernel to PTX for compute capability 9.0 with a stand-in for the device
(numba asks the current device's capability when it compiles device functions, and the
package asks it to decide whether to emit ``cp.async`` and ``griddepcontrol``); ptxas from the
``nvidia-cuda-nvcc-cu12`` wheel assembles it at the kernel's register cap and prints its
registers, stack and spills; nvdisasm lists the SASS. Prints the instruction mix, the spill
instructions inside the multiply-add span (the main loop, up to ``griddepcontrol.wait``:
``ACQBULK`` in SASS) and the epilogue's size (what follows that wait), and writes
PREFIX.ptx / .cubin / .sass. The GPU's own ptxas may differ by a few instructions; its register
counts and stack sizes agree with this one's for the kernels compared (the eval gather: 128
registers, 48 B of stack). Compare two trees by running it in each.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

CC = (9, 0)


def instructions(sass: str) -> list[str]:
    """The SASS listing's instructions, predicate guards and all, in order."""
    return [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]


def op_counts(sass: str) -> collections.Counter:
    """Instructions per opcode (``FFMA``, ``LDG``, ...: modifiers and guards dropped)."""
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                               for t in instructions(sass))


def tool(name: str) -> str:
    """A CUDA binary from the wheels beside numba (``nvidia/*/bin``)."""
    import nvidia

    for root in nvidia.__path__:
        for path in sorted(Path(root).glob(f"*/bin/{name}")):
            return str(path)
    sys.exit(f"{name} not found: pip install -e '.[sass]'")


def stand_in_device() -> None:
    """Make numba and the package compile for compute capability CC without a device."""
    from numba_deconv.kernels import async_copy, ptx as ptx_mod

    # (async_copy holds its own reference: its copies are cp.async only where it says so)
    ptx_mod.device_at_least = async_copy.device_at_least = lambda cc: tuple(cc) <= CC
    import numba.cuda.dispatcher as dispatcher

    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=CC)


def default_gather(mode: str):
    """(kernel, signature, tiling) of the default problem's gather in ``mode`` (eval, train,
    scaled), at the tile its GPU launch takes (``gather.tilings``' first)."""
    import numba
    from numba import float32, float64

    from numba_deconv import bench
    from numba_deconv.kernels import gather

    case = bench.default_case()
    geom = case.geometry()
    tiling = gather.GatherTiling(4, 2, 2, 16, 128, 128)  # the GPU launch's tile
    out_spatial = tuple(a.output_size(n) for a, n in zip(geom.axes(), case.spatial))
    launch = gather.gather_launch(geom, case.batch, case.spatial, out_spatial, "float32", tiling)
    kernel = gather.gather_kernel(launch, "float32", mode == "train", mode == "scaled")
    sizes, divs = launch.dims
    sig = (float32[::1], float32[::1], float64[:, ::1], float32[::1], float32[::1],
           float64[:, :, ::1], numba.typeof(sizes), numba.typeof(divs))
    return kernel, sig, tiling


def compile_gather(mode: str, prefix: str) -> tuple[str, str]:
    """PTX, ptxas' report and the SASS of the default problem's gather kernel."""
    stand_in_device()
    from numba import cuda

    kernel, sig, tiling = default_gather(mode)
    return assemble(cuda.compile_ptx(kernel.py_func, sig, cc=CC)[0], prefix, tiling.max_regs)


def compile_gather_mma(mode: str, prefix: str, operand: str = "tf32",
                       row: str = "default") -> tuple[str, str]:
    """PTX, ptxas' report and the SASS of a suite row's tensor-core gather (``row``: the
    default problem's) in ``mode`` (``eval``, ``train``), at its GPU tiling, on ``operand``'s
    operands (``gather_mma.OPERANDS``; a half dtype's evaluation stores its output in that
    dtype, as a half-precision call's does)."""
    stand_in_device()
    import numba
    from numba import cuda, float32, float64, int32, uint16

    from numba_deconv import bench
    from numba_deconv.kernels import gather_mma

    case = bench.select_cases([row])[0]
    geom = case.geometry()
    out_spatial = tuple(a.output_size(n) for a, n in zip(geom.axes(), case.spatial))
    launch = gather_mma.mma_launch(geom, case.batch, case.spatial, out_spatial, operand=operand)
    half = operand in gather_mma.HALF_OPERAND_KINDS
    store = operand if half and mode == "eval" else ""
    kernel = gather_mma.mma_kernel(launch, mode, store)
    sizes, divs = launch.dims
    word = int32[::1] if half else float32[::1]
    sig = (word, word, float64[:, ::1], word if mode == "eval" else float32[::1],
           uint16[::1] if store else float32[::1], float64[:, :, ::1], numba.typeof(sizes),
           numba.typeof(divs))
    return assemble(cuda.compile_ptx(kernel.py_func, sig, cc=CC)[0], prefix,
                    gather_mma.MAX_REGS)


# gram_sums' cases: the default problem's (one team per slot) and a small one (four teams)
GRAM_CASES = {"default": ((16, 32, 3, 2, 1), (16, 32, 32), 16),
              "small": ((5, 7, 3, 2, 1), (5, 9, 11), 2)}


def compile_gram_sums(case: str, dtype: str, prefix: str) -> tuple[str, str]:
    """PTX, ptxas' report and the SASS of a ``GRAM_CASES`` problem's ``gram_sums`` kernel
    (planned for 132 SMs, an H100's)."""
    stand_in_device()
    import numba
    from numba import cuda, float64, int64

    from numba_deconv import testing
    from numba_deconv.gram_plan import gram_plan
    from numba_deconv.kernels import gram

    args, spatial, batch = GRAM_CASES[case]
    nt = getattr(numba, dtype)
    plan = gram_plan(testing.ConvGeometry.create(*args), batch, spatial,
                     nt.bitwidth // 8, 132, gram.BLOCK)
    kernel = gram.make_gram_sums(dtype, plan)
    sig = (nt[::1], numba.typeof(plan.tiles), numba.typeof(plan.blocks), nt[:, ::1],
           float64[:, ::1], nt[::1], int64, int64, int64, int64)
    return assemble(cuda.compile_ptx(kernel.py_func, sig, cc=CC)[0], prefix, gram.MAX_REGS)


def compile_box_sums(dtype: str, prefix: str) -> tuple[str, str]:
    """PTX, ptxas' report and the SASS of the default problem's ``box_sums`` (kernel 3x3x3,
    float32 rows as 16-byte quads; float64 rows value by value), typed as its launch types it."""
    stand_in_device()
    import numba
    import numpy as np
    from numba import cuda

    from numba_deconv import bench
    from numba_deconv.kernels import box_sums as bs
    from numba_deconv.kernels.launch import block_size

    case = bench.default_case()
    geom = case.geometry()
    ci = geom.in_channels
    kernel = bs.make_box_sums(*geom.kernel_size, dtype, bs.ROWS, False, dtype == "float32")
    dims = bs.launch_dims(ci, ci // geom.groups, case.spatial, block_size(bs.BLOCK))
    arr = lambda dt, nd: numba.types.Array(numba.from_dtype(np.dtype(dt)), nd, "C")  # noqa: E731
    sig = (arr(dtype, 5), arr(dtype, 1), arr("int32", 2), arr("int32", 2), numba.typeof(dims),
           arr("float64", 2), arr(dtype, 3), arr("float64", 1), numba.float64, arr("float64", 3),
           arr("float64", 2), arr("int32", 1))
    cap = kernel.targetoptions.get("max_registers") or 0
    return assemble(cuda.compile_ptx(kernel.py_func, sig, cc=CC)[0], prefix, cap)


def assemble(ptx: str, prefix: str, max_regs: int) -> tuple[str, str]:
    """ptxas' report and the SASS of ``ptx`` (written to PREFIX.ptx / .cubin / .sass)."""
    # NVVM may stamp a PTX version newer than the wheel's ptxas reads; nothing here needs it
    ptx = re.sub(r"^\.version \d+\.\d+", ".version 8.0", ptx, count=1, flags=re.M)
    Path(prefix + ".ptx").write_text(ptx)
    cap = [f"--maxrregcount={max_regs}"] if max_regs else []
    report = subprocess.run([tool("ptxas"), f"-arch=sm_{CC[0]}{CC[1]}", "-v", *cap,
                             prefix + ".ptx", "-o", prefix + ".cubin"],
                            capture_output=True, text=True, check=True)
    sass = subprocess.run([tool("nvdisasm"), "-c", prefix + ".cubin"], capture_output=True,
                          text=True, check=True).stdout
    Path(prefix + ".sass").write_text(sass)
    return report.stderr + report.stdout, sass


def summary(sass: str) -> str:
    ins = instructions(sass)
    ops = op_counts(sass)
    wait = next((k for k, t in enumerate(ins) if t.strip().startswith("ACQBULK")), len(ins))
    ffma = [k for k, t in enumerate(ins[:wait]) if "FFMA" in t]  # (the epilogue's are not)
    span = ins[ffma[0]:ffma[-1] + 1] if ffma else []
    spills = sum(("LDL" in t or "STL" in t) for t in span)
    tail = ins[wait:]
    return (f"{len(ins)} instructions: {dict(ops.most_common(12))}\n"
            f"spill loads/stores inside the multiply-add span: {spills}\n"
            f"after griddepcontrol.wait: {len(tail)} instructions "
            f"({sum('ISETP' in t for t in tail)} ISETP, {sum('STG' in t for t in tail)} STG)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="?", default="eval",
                        choices=("eval", "train", "scaled", "mma", "mma-train", "gram", "box"))
    parser.add_argument("--case", default="default", choices=tuple(GRAM_CASES),
                        help="gram: which problem's gram_sums")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                        help="gram, box: the input's dtype")
    parser.add_argument("--operand", default="tf32",
                        choices=("tf32", "bfloat16", "float16", "tf32x3"),
                        help="mma, mma-train: the tensor-core operands' precision")
    parser.add_argument("--row", default="default",
                        help="mma, mma-train: the suite row whose kernel to compile")
    parser.add_argument("--out", default="gather_sm90")
    args = parser.parse_args()
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")  # the real compiler, no device needed
    if args.mode == "gram":
        report, sass = compile_gram_sums(args.case, args.dtype, args.out)
    elif args.mode == "box":
        report, sass = compile_box_sums(args.dtype, args.out)
    elif args.mode.startswith("mma"):
        report, sass = compile_gather_mma("train" if args.mode == "mma-train" else "eval",
                                          args.out, args.operand, args.row)
    else:
        report, sass = compile_gather(args.mode, args.out)
    print("\n".join(line.strip() for line in report.splitlines()
                    if "Used" in line or "spill" in line))
    print(summary(sass))


if __name__ == "__main__":
    main()
