"""The convolution's two gradients alone: this package's kernels against cuDNN's (GPU only).

Answers: per geometry, how long do ``conv_grads.launch_input_grad`` (``dL/dx``) and
``conv_grads.launch_weight_grad`` (``dL/dW``) take on CUDA cores, and how long does PyTorch's
``aten.convolution_backward`` take for each, in TF32 (PyTorch's default for cuDNN), in TF32
restricted to cuDNN's deterministic algorithms (``det``), and in strict float32? The numbers
calibrate the planner's backward (``planner.predict_input_grad``; the backward runs the input
gradient alone as ``conv3d(dy, W)``, the same cuDNN forward convolution that
``aten.convolution_backward`` runs for a transposed convolution's input gradient, and both
gradients as one ``aten.convolution_backward`` call, ``backward.grads_torch``).

    PYTHONPATH=$PWD python3 benchmarks/probe_backward.py [--rows NAME ...] [--reps R] [--host]
        [--random N [--seed S] [--json PATH]]

Rows: the shape suite's float32 rows and a channel sweep at kernel 3, stride 2, padding 1 on a
16x32x32 input, plus a few other kernels. Each gradient is checked against float64 PyTorch
first (relative error printed), then its launches captured ``CALLS`` times in one CUDA graph
and the replay timed with CUDA events (median of ``--reps`` replays, per call): GPU time only.
``--random N``: instead of the rows, N geometries drawn from ``--seed`` (``draw``: channels
3-256, kernels 1-5 per axis, strides 1-3, dilation and groups at times, batches 1-16, inputs
of 2-24 per axis), the planner's calibration set; ``--json`` writes every row's numbers.

``det both``: both gradients in one deterministic call, as ``backward.grads_torch`` makes it.
``--host`` asks instead what each costs the host: µs per call of the kernels' launches and of
the backward's PyTorch gradients (``backward.input_grad_torch``, ``backward.weight_grad_torch``,
``backward.grads_torch``),
issued ``HOST_CALLS`` at a time while the GPU sleeps (so no call waits for it), on the caller's
thread (``st``) and inside an autograd backward, on autograd's device thread (``mt``), where
the operator's backward runs; median of ``--reps`` batches.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

import numba_deconv  # noqa: F401  (compat + backend before numba.cuda compiles)
from numba_deconv import backward, bench, testing
from numba_deconv.bench import Case, _conv
from numba_deconv.kernels import conv_grads

CALLS = 5
HOST_CALLS = 20


def rows() -> list[Case]:
    suite = [c for c in bench.suite_cases() if c.dtype == "float32"]
    sweep = [Case(f"k3s2p1_{c}to{c}_b{b}", _conv(c, c, 3, 2, 1), b, (16, 32, 32))
             for c, b in ((32, 8), (48, 8), (96, 4), (128, 4), (192, 2), (256, 2))]
    other = [
        Case("k3s2p1_64to32_b8", _conv(64, 32, 3, 2, 1), 8, (16, 32, 32)),
        Case("k3s2p1_16to64_b8", _conv(16, 64, 3, 2, 1), 8, (16, 32, 32)),
        Case("k5s1p2_32to32_b2", _conv(32, 32, 5, 1, 2), 2, (16, 32, 32)),
        Case("k2s2_128to64_b2", _conv(128, 64, 2, 2, 0), 2, (16, 16, 16)),
        Case("k1s1_64to64_b4", _conv(64, 64, 1, 1, 0), 4, (16, 32, 32)),
        Case("k3s1p1_48to48_b4", _conv(48, 48, 3, 1, 1), 4, (16, 32, 32)),
        Case("k3s2p1_g4_128to128_b4", _conv(128, 128, 3, 2, 1, groups=4), 4, (16, 32, 32)),
        Case("k3s2p2d2_64to64_b4", _conv(64, 64, 3, 2, 2, dilation=2), 4, (16, 32, 32)),
        Case("k3s2p1_24to24_b16", _conv(24, 24, 3, 2, 1), 16, (16, 32, 32)),
        Case("k4s2p1_48to48_b4", _conv(48, 48, 4, 2, 1), 4, (16, 24, 24)),
    ]
    return suite + sweep + other


def draw(rng: random.Random, index: int) -> Case | None:
    """One random geometry (``--random``), or None where it is invalid or too large."""
    groups = rng.choice([1, 1, 1, 1, 2, 4])
    cin = groups * rng.choice([1, 3, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128])
    cout = groups * rng.choice([1, 4, 8, 16, 32, 48, 64, 96, 128])
    if cin > 256 or cout > 256:
        return None
    cubic = rng.random() < 0.8
    k = rng.randint(1, 5)
    kernel = (k,) * 3 if cubic else tuple(rng.randint(1, 5) for _ in range(3))
    s = rng.randint(1, 3)
    d = rng.choice([1, 1, 1, 2])
    p = rng.randint(0, d * (min(kernel) - 1)) if min(kernel) > 1 else 0
    batch = rng.choice([1, 2, 4, 8, 16])
    spatial = tuple(rng.randint(2, 24) for _ in range(3))
    out = [(n - 1) * s - 2 * p + d * (kk - 1) + 1 for n, kk in zip(spatial, kernel)]
    if min(out) < 1 or batch * cout * out[0] * out[1] * out[2] > 32e6:
        return None
    case = Case(f"r{index}", _conv(cin, cout, kernel, s, p, dilation=d, groups=groups), batch,
                spatial)
    if case.geometry().macs(batch, spatial) > 30e9:
        return None
    return case


def random_rows(count: int, seed: int) -> list[Case]:
    rng, cases, index = random.Random(seed), [], 0
    while len(cases) < count:
        case = draw(rng, index)
        index += 1
        if case is not None:
            cases.append(case)
    return cases


def cudnn(dy, x, w, conv, mask):
    out_pad = tuple(int(v) for v in conv.output_padding)
    return torch.ops.aten.convolution_backward(
        dy, x, w, None, list(conv.stride), list(conv.padding), list(conv.dilation), True,
        list(out_pad), conv.groups, mask)


def run(case: Case, reps: int) -> dict:
    model, x = case.build("cuda")
    conv = model.conv_transpose
    w = conv.weight.detach().contiguous()
    geom = case.geometry()
    dy = torch.randn(case.output_shape(), device="cuda")
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    ref = cudnn(dy64, x64, w64, conv, [True, True, False])
    args = (tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation))
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    scratch = conv_grads.weight_grad_scratch(x, dy, dw, *args, conv.groups)
    row = dict(name=case.name, init=case.init, batch=case.batch, spatial=case.spatial,
               c=(geom.in_per_group * geom.out_per_group) ** 0.5,
               macs=geom.macs(case.batch, case.spatial), outputs=dy.numel(), inputs=x.numel())

    def ours_dx():
        conv_grads.launch_input_grad(dy, w, dx, *args)

    def ours_dw():
        conv_grads.launch_weight_grad(x, dy, dw, *args, conv.groups, scratch=scratch)

    for fn in (ours_dx, ours_dw):
        fn()
        fn()
    torch.cuda.synchronize()
    row["err_ours_dx"] = testing.relative_error(dx, ref[0])
    row["err_ours_dw"] = testing.relative_error(dw, ref[1])
    row["ours_dx"] = bench.graph_time_us(ours_dx, calls=CALLS, reps=reps)
    row["ours_dw"] = bench.graph_time_us(ours_dw, calls=CALLS, reps=reps)
    for label, ctx in (("tf32", _nothing()), ("det", _deterministic()),
                       ("ieee", bench.strict_fp32())):
        with ctx:
            for i, what in enumerate(("dx", "dw")):
                mask = [i == 0, i == 1, False]
                got = cudnn(dy, x, w, conv, mask)[i]
                row[f"err_{label}_{what}"] = testing.relative_error(got, ref[i])
                row[f"{label}_{what}"] = bench.graph_time_us(
                    lambda m=mask: cudnn(dy, x, w, conv, m), calls=CALLS, reps=reps)
    with _deterministic():  # both in one call, as backward.grads_torch
        both = cudnn(dy, x, w, conv, [True, True, False])
        row["err_det_both"] = max(testing.relative_error(both[i], ref[i]) for i in (0, 1))
        row["det_both"] = bench.graph_time_us(
            lambda: cudnn(dy, x, w, conv, [True, True, False]), calls=CALLS, reps=reps)
    return row


def host(case: Case, reps: int) -> dict:
    """Host µs per call of each gradient's launches (``--host``)."""
    model, x = case.build("cuda")
    conv = model.conv_transpose
    w = conv.weight.detach().contiguous()
    dy = torch.randn(case.output_shape(), device="cuda")
    args = (tuple(conv.stride), tuple(conv.padding), tuple(conv.dilation))
    geometry = (*args, conv.groups)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    scratch = conv_grads.weight_grad_scratch(x, dy, dw, *args, conv.groups)
    calls = {
        "ours_dx": lambda: conv_grads.launch_input_grad(dy, w, dx, *args),
        "ours_dw": lambda: conv_grads.launch_weight_grad(x, dy, dw, *args, conv.groups,
                                                         scratch=scratch),
        "torch_dx": lambda: backward.input_grad_torch(dy, w, x.shape, geometry),
        "torch_dw": lambda: backward.weight_grad_torch(dy, x, w, geometry),
        "torch_both": lambda: backward.grads_torch(dy, x, w, geometry),
    }
    row = dict(name=case.name)
    for name, fn in calls.items():
        fn()
        fn()
        for thread in ("st", "mt"):
            row[f"{thread}_{name}"] = statistics.median(
                _host_us(fn, thread == "mt") for _ in range(reps))
    return row


def _host_us(fn, on_autograd_thread: bool) -> float:
    """µs per call of ``HOST_CALLS`` calls of ``fn`` issued while the GPU sleeps."""
    torch.cuda.synchronize()
    torch.cuda._sleep(60_000_000)  # ~30 ms at H200 clocks: longer than the calls' issue

    def timed():
        start = time.perf_counter_ns()
        for _ in range(HOST_CALLS):
            fn()
        return (time.perf_counter_ns() - start) / HOST_CALLS / 1e3

    if not on_autograd_thread:
        return timed()
    seen = []

    class Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(timed())
            return g

    probe = torch.zeros(1, device="cuda", requires_grad=True)
    Timed.apply(probe).sum().backward()
    torch.cuda.synchronize()
    return seen[0]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _deterministic:
    """cuDNN restricted to its deterministic algorithms (TF32 left as PyTorch's default)."""

    def __enter__(self):
        self.saved = torch.backends.cudnn.deterministic
        torch.backends.cudnn.deterministic = True
        return self

    def __exit__(self, *exc):
        torch.backends.cudnn.deterministic = self.saved
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="row names (default: all)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--host", action="store_true", help="host µs per call instead")
    parser.add_argument("--random", type=int, default=0, help="random geometries instead")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--json", help="write the rows' numbers here")
    args = parser.parse_args()
    if not torch.cuda.is_available() or bench.is_simulator():
        sys.exit("probe_backward: needs a GPU")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    if args.host:
        return main_host(args)
    table = []
    for case in random_rows(args.random, args.seed) if args.random else rows():
        if args.rows and case.name not in args.rows:
            continue
        if args.random:
            print(case.name, case.describe(), flush=True)
        try:
            r = run(case, args.reps)
        except Exception as exc:  # noqa: BLE001 - a failing row is reported, not fatal
            print("FAILED", case.name, repr(exc)[:300], flush=True)
            continue
        print(r, flush=True)
        table.append(r)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(table, f, default=list)
    print(f"{'row':24} {'c':>6} {'GMAC':>6} {'Mout':>6} | {'ours dx':>8} {'ours dw':>8} | "
          f"{'tf32 dx':>8} {'tf32 dw':>8} {'det dx':>8} {'det dw':>8} {'det both':>8} | "
          f"{'ieee dx':>8} {'ieee dw':>8} | {'err ours':>8} {'err tf32':>8}  (us)")
    for r in table:
        print(f"{r['name']:24} {r['c']:6.1f} {r['macs'] / 1e9:6.2f} {r['outputs'] / 1e6:6.2f} | "
              f"{r['ours_dx']:8.1f} {r['ours_dw']:8.1f} | {r['tf32_dx']:8.1f} "
              f"{r['tf32_dw']:8.1f} {r['det_dx']:8.1f} {r['det_dw']:8.1f} {r['det_both']:8.1f} | "
              f"{r['ieee_dx']:8.1f} {r['ieee_dw']:8.1f} | "
              f"{max(r['err_ours_dx'], r['err_ours_dw']):8.1e} "
              f"{max(r['err_tf32_dx'], r['err_tf32_dw']):8.1e}")


def main_host(args) -> None:
    names = ("ours_dx", "ours_dw", "torch_dx", "torch_dw", "torch_both")
    table = []
    for case in rows():
        if args.rows and case.name not in args.rows:
            continue
        table.append(host(case, args.reps))
        print(table[-1], flush=True)
    print("host µs per call, st: caller's thread / mt: autograd's device thread")
    print(f"{'row':24} " + " ".join(f"{n:>15}" for n in names))
    for r in table:
        print(f"{r['name']:24} " + " ".join(
            f"{r['st_' + n]:7.1f}/{r['mt_' + n]:7.1f}" for n in names))


if __name__ == "__main__":
    main()
