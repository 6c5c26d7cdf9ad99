"""Command line: ``python -m numba_deconv [run|bench|explain|cache] ...`` (``run`` when none is
given).

``run``      check the operator against PyTorch in float64, in train then eval mode (output and
             running statistics), and time it. Without geometry options it checks ``ModelNew``
             on the default problem (KernelBench level 2 #15), reduced under the CUDA simulator
             and said so; with any geometry option it checks ``Pipeline.from_modules(conv, bn)``
             on exactly the problem asked for. Exit 0 only when every relative error is within
             1e-4 (the output's within 1e-3 where the convolution runs in TF32, as PyTorch's
             does under its flag: ``Pipeline.conv_precision``).
``bench``    the benchmark of :mod:`numba_deconv.bench` (needs a GPU; exits 2 without one).
``explain``  the pipeline's report (``Pipeline.explain``) for the default problem or the one given.
``cache``    the kernel cache on disk (``kernels.disk_cache``): where, entries, size; ``--clear``.

Every option is checked by argparse: a bad value, a geometry PyTorch refuses or an unknown
command is a usage error (exit 2, one message naming the problem), never a traceback. The help
texts below are plain text; this docstring is for readers of the source.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import textwrap
import time
from dataclasses import dataclass

from torch import nn

import numba_deconv  # noqa: F401  (selects GPU or simulator before numba/torch-cuda work)
from numba_deconv import folding, reference
from numba_deconv.geometry import ConvGeometry
from numba_deconv.simulator import is_simulator

COMMANDS = ("run", "bench", "explain", "cache")
DTYPES = ("float32", "float64")
RUN_RTOL = 1e-4
#: the output's bound where the call's convolution runs in TF32 (PyTorch's flag allowing it):
#: TF32's own error is ~3e-4, eager's included
RUN_TF32_RTOL = 1e-3
RUN_REPS = 20
#: Reduced problem under the simulator (same kernel, stride and padding as the default).
SIM_BATCH, SIM_IN, SIM_OUT, SIM_SPATIAL = 2, 4, 8, (3, 5, 4)
#: The options that set the problem's sizes; giving any of them makes ``run`` check exactly the
#: problem asked for (the others keep the default problem's values), even under the simulator.
GEOMETRY_OPTIONS = ("in_channels", "out_channels", "kernel", "stride", "padding", "output_padding",
                    "dilation", "groups", "input", "batch")

DESCRIPTION = "ConvTranspose3d -> BatchNorm3d -> subtract the spatial mean, as Numba CUDA kernels."
EPILOG = f"""\
commands:
  run       check the operator against PyTorch in float64, in train then eval mode,
            and time it; exit status 0 only when every relative error is within
            {RUN_RTOL:.0e} ({RUN_TF32_RTOL:.0e} for an output computed in TF32), else 1 (the
            command used when none is given)
  bench     benchmark against PyTorch and write tables and plots (needs a GPU;
            exit status 2 without one)
  explain   print the pipeline's plan: stages, kernels, launch shapes, resources
            and performance floors
  cache     where compiled kernels are kept across processes, and how many;
            --clear empties it

Without a command, run is used: "python -m numba_deconv --reps 5" is
"python -m numba_deconv run --reps 5". "python -m numba_deconv COMMAND --help"
lists a command's options.
"""
DEFAULT_PROBLEM = (f"batch {reference.batch_size}, {reference.in_channels}->"
                   f"{reference.out_channels} channels, input {reference.depth}x{reference.height}"
                   f"x{reference.width}, kernel {reference.kernel_size}, stride {reference.stride}, "
                   f"padding {reference.padding}")


def _paragraphs(*paragraphs: str, width: int = 79) -> str:
    """Plain text for a help screen: each paragraph filled to ``width`` columns."""
    return "\n\n".join(textwrap.fill(p, width) for p in paragraphs)


RUN_DESCRIPTION = _paragraphs(
    "Check the operator against PyTorch in float64, in train then eval mode (the output, then "
    "the running statistics and the batch counter), and time it.",
    f"Without geometry options it checks ModelNew on the default problem ({DEFAULT_PROBLEM}); "
    f"under the CUDA simulator (no GPU) on a reduced problem instead (batch {SIM_BATCH}, "
    f"{SIM_IN}->{SIM_OUT} channels, input {'x'.join(map(str, SIM_SPATIAL))}, the same kernel, "
    "stride and padding), and it says so. With any geometry option it checks "
    "Pipeline.from_modules(conv, bn) on exactly the problem asked for, the options not given "
    "keeping the default problem's values; under the simulator a large problem takes long.",
    f"Exit status: 0 when every relative error is within {RUN_RTOL:.0e} (an output whose "
    f"convolution runs in TF32, as PyTorch's does under its flag: {RUN_TF32_RTOL:.0e}), 1 "
    "otherwise, 2 for a usage error.")
BENCH_DESCRIPTION = _paragraphs(
    "Benchmark the Numba pipeline against PyTorch (eager, and compiled where available) on the "
    "default problem, in train and eval mode, and write a table, CSV and JSON to the output "
    "directory. Needs a GPU: under the CUDA simulator it prints one line and exits with "
    "status 2.")
EXPLAIN_DESCRIPTION = _paragraphs(
    "Print the pipeline's plan for one input shape: its stages, the kernel of each, launch "
    "shapes, the work and bytes of each stage and the floors they imply; on a GPU also each "
    "kernel's registers, shared memory and occupancy, and with --measure the measured times.",
    f"The problem is the default one ({DEFAULT_PROBLEM}) unless geometry options say otherwise.")
CACHE_DESCRIPTION = _paragraphs(
    "Compiled kernels are kept on disk, so a new process reuses what an earlier one compiled "
    "instead of compiling for seconds. This prints where they are (NUMBA_DECONV_CACHE_DIR, "
    "else $XDG_CACHE_HOME/numba_deconv), how many there are and their size; --clear removes "
    "them. NUMBA_DECONV_CACHE=0 turns the cache off, NUMBA_DECONV_CACHE_MAX_MB bounds it.")
PROBLEM_DESCRIPTION = _paragraphs(
    "K, S, P, OP and DIL take one integer or three comma-separated ones (depth,height,width), "
    "e.g. --kernel 3 or --kernel 1,4,1. The defaults are the default problem's.", width=77)


# ---- argument types -----------------------------------------------------------------------------
def _names(text: str) -> list[str]:
    """Comma-separated names (argparse type), at least one."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected one or more comma-separated names")
    return names


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    return _int_at_least(text, 1)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(
            f"must be {'a positive integer' if minimum == 1 else f'an integer >= {minimum}'}, "
            f"got {text!r}")
    return value


def int_or_triple(minimum: int):
    """Argparse type: one integer or three comma-separated integers, each >= ``minimum``;
    returns an int or a tuple of three ints."""

    def parse(text: str) -> int | tuple[int, int, int]:
        parts = text.split(",")
        if len(parts) not in (1, 3):
            raise argparse.ArgumentTypeError(
                f"expected one integer or three comma-separated integers (like 3 or 1,4,1), "
                f"got {text!r}")
        try:
            values = [_int_at_least(part, minimum) for part in parts]
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(f"{err} in {text!r}" if len(parts) == 3 else str(err))
        return values[0] if len(values) == 1 else tuple(values)

    parse.__name__ = f"int_or_triple_{minimum}"
    return parse


def spatial_size(text: str) -> tuple[int, int, int]:
    """Argparse type: the input's spatial size, D,H,W (or one integer for a cube), each >= 1."""
    value = int_or_triple(1)(text)
    return (value,) * 3 if isinstance(value, int) else value


# ---- parser -------------------------------------------------------------------------------------
def package_version() -> str:
    """The installed distribution's version, else the package's ``__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("numba_deconv")
    except PackageNotFoundError:
        return getattr(numba_deconv, "__version__", "unknown")


def _problem_options() -> argparse.ArgumentParser:
    """The options of ``run`` and ``explain`` that set the problem (a parent parser)."""
    parent = argparse.ArgumentParser(add_help=False)
    g = parent.add_argument_group("problem", PROBLEM_DESCRIPTION)
    g.add_argument("--in-channels", type=positive_int, metavar="N",
                   help=f"input channels (default {reference.in_channels})")
    g.add_argument("--out-channels", type=positive_int, metavar="N",
                   help=f"output channels (default {reference.out_channels})")
    g.add_argument("--kernel", type=int_or_triple(1), metavar="K",
                   help=f"kernel size (default {reference.kernel_size})")
    g.add_argument("--stride", type=int_or_triple(1), metavar="S",
                   help=f"stride (default {reference.stride})")
    g.add_argument("--padding", type=int_or_triple(0), metavar="P",
                   help=f"padding (default {reference.padding})")
    g.add_argument("--output-padding", type=int_or_triple(0), metavar="OP",
                   help="output padding, smaller than the stride or the dilation (default 0)")
    g.add_argument("--dilation", type=int_or_triple(1), metavar="DIL",
                   help="dilation (default 1)")
    g.add_argument("--groups", type=positive_int, metavar="G",
                   help="groups, dividing both channel counts (default 1)")
    g.add_argument("--input", type=spatial_size, metavar="D,H,W",
                   help=f"the input's spatial size (default {reference.depth},{reference.height},"
                        f"{reference.width})")
    g.add_argument("--batch", type=positive_int, metavar="N",
                   help=f"batch size (default {reference.batch_size})")
    g.add_argument("--bias", action=argparse.BooleanOptionalAction, default=True,
                   help="whether the convolution has a bias (default: it has)")
    g.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the input's and parameters' dtype (default float32)")
    return parent


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each command's parser."""
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="python -m numba_deconv", description=DESCRIPTION,
                                epilog=EPILOG, formatter_class=raw)
    p.add_argument("--version", action="version", version=f"numba_deconv {package_version()}")
    sub = p.add_subparsers(dest="command", metavar="{run,bench,explain,cache}",
                           help="the command (run when none is given), described below")
    problem = _problem_options()

    run = sub.add_parser("run", parents=[problem], formatter_class=raw,
                         description=RUN_DESCRIPTION)
    run.add_argument("--reps", type=positive_int, default=RUN_REPS,
                     help="timed calls on a GPU, of which the median is reported (default "
                          "%(default)s)")

    b = sub.add_parser("bench", formatter_class=raw, description=BENCH_DESCRIPTION)
    b.add_argument("--out", default="benchmarks/results",
                   help="output directory (default %(default)s)")
    b.add_argument("--tiny", action="store_true", help="add a 1x4x4x4x4 latency case")
    b.add_argument("--geometry", action="store_true",
                   help="add a non-cubic, strided, grouped, dilated case")
    b.add_argument("--sweep", action="store_true", help="sweep batch and input size, plot")
    b.add_argument("--suite", action="store_true",
                   help="time the shape suite: several geometries, both modes, back to back "
                        "and synchronized after every call")
    b.add_argument("--rows", type=_names, default=None,
                   help="with --suite: only these rows, comma-separated (default: every row; "
                        "the names are the suite table's, e.g. default,tiny)")
    b.add_argument("--first-call", action="store_true",
                   help="time first calls in new processes: cold and warm kernel cache, a "
                        "new geometry in a warm process, the same for the generic tier, and "
                        "the calls of a new geometry under specialize='auto'")
    b.add_argument("--ddp", action="store_true",
                   help="time a DDP training step on one GPU and on two, against eager "
                        "SyncBatchNorm under DDP (needs two GPUs for the two-GPU rows)")
    b.add_argument("--reps", type=positive_int, default=100,
                   help="timed calls per main-table row (default %(default)s)")

    e = sub.add_parser("explain", parents=[problem], formatter_class=raw,
                       description=EXPLAIN_DESCRIPTION)
    e.add_argument("--mode", choices=("train", "eval"), default="train",
                   help="the mode to plan for (default %(default)s)")
    e.add_argument("--measure", action="store_true",
                   help="also time the whole call and every launch (GPU only)")
    e.add_argument("--variance", choices=("auto", "epilogue", "gram"), default="auto",
                   help="training's variance: auto (the default: the gather's epilogue), "
                        "the gather's epilogue, or the Gram sums")
    e.add_argument("--generic", action="store_true",
                   help="plan the generic tier (Pipeline(specialize=False)): kernels that take "
                        "the geometry at run time")
    c = sub.add_parser("cache", formatter_class=raw, description=CACHE_DESCRIPTION)
    c.add_argument("--clear", action="store_true", help="remove every compiled kernel")
    return p, {"run": run, "bench": b, "explain": e, "cache": c}


def _parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def _is_run_option(run_parser: argparse.ArgumentParser, word: str) -> bool:
    """Whether ``word`` starts an option of ``run`` (exactly, as ``--opt=value``, or as an
    unambiguous-or-not prefix of a long option, as argparse accepts); ``-h`` belongs to the
    top level."""
    if not word.startswith("-") or word in ("-h", "--help", "--version"):
        return False
    name = word.split("=", 1)[0]
    options = run_parser._option_string_actions  # argparse's table of option strings
    if name in options:
        return True
    return name.startswith("--") and any(o.startswith(name) for o in options if o.startswith("--"))


# ---- the problem --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """What ``run`` and ``explain`` work on: a validated geometry, an input shape, a dtype."""

    geometry: ConvGeometry
    input_shape: tuple[int, int, int, int, int]
    dtype: str = "float32"
    #: True when geometry options were given: ``run`` then checks ``Pipeline.from_modules``;
    #: otherwise the default problem (or the simulator's reduced one) on ``ModelNew``.
    custom: bool = False
    reduced: bool = False  # the simulator's reduced problem

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def describe(self) -> str:
        g = self.geometry

        def axes(v):
            return str(v[0]) if len(set(v)) == 1 else ",".join(map(str, v))

        parts = [f"input {self.input_shape}", f"in->out channels {g.in_channels}->{g.out_channels}",
                 f"kernel {axes(g.kernel_size)} stride {axes(g.stride)} padding {axes(g.padding)}"]
        if any(g.output_padding):
            parts.append(f"output padding {axes(g.output_padding)}")
        if any(d != 1 for d in g.dilation):
            parts.append(f"dilation {axes(g.dilation)}")
        if g.groups != 1:
            parts.append(f"groups {g.groups}")
        parts.append("bias" if g.bias else "no bias")
        parts.append(self.dtype)
        return ", ".join(parts)


def default_problem(sim: bool, *, bias: bool = True, dtype: str = "float32") -> Problem:
    """The default problem, or under the simulator the reduced one ``run`` checks."""
    cin, cout, k, s, p = reference.get_init_inputs()
    if sim:
        cin, cout, batch, spatial = SIM_IN, SIM_OUT, SIM_BATCH, SIM_SPATIAL
    else:
        batch, spatial = reference.batch_size, (reference.depth, reference.height, reference.width)
    geom = ConvGeometry.create(cin, cout, k, s, p, bias=bias)
    return Problem(geom, (batch, cin, *spatial), dtype, custom=False, reduced=sim)


def problem_from_args(args: argparse.Namespace, *, reduce: bool, training: bool) -> Problem:
    """The problem the options describe; ``ValueError`` naming the parameter for one PyTorch
    refuses (or, when ``training``, a batch with one value per channel). With no geometry
    option and ``reduce``, the simulator's reduced problem."""
    given = {name: getattr(args, name) for name in GEOMETRY_OPTIONS
             if getattr(args, name, None) is not None}
    if not given:
        problem = default_problem(reduce, bias=args.bias, dtype=args.dtype)
    else:
        v = dict(in_channels=reference.in_channels, out_channels=reference.out_channels,
                 kernel=reference.kernel_size, stride=reference.stride, padding=reference.padding,
                 output_padding=0, dilation=1, groups=1,
                 input=(reference.depth, reference.height, reference.width),
                 batch=reference.batch_size)
        v.update(given)
        geom = ConvGeometry.create(v["in_channels"], v["out_channels"], v["kernel"], v["stride"],
                                   v["padding"], v["output_padding"], v["groups"], args.bias,
                                   v["dilation"])
        problem = Problem(geom, (v["batch"], v["in_channels"], *v["input"]), args.dtype,
                          custom=True)
    batch, out_spatial = problem.geometry.check_input_shape(problem.input_shape)
    if training:
        folding.check_batch_size(batch, math.prod(out_spatial), problem.geometry.out_channels)
    return problem


class ReferenceModel(nn.Module):
    """``reference.Model`` for any geometry: ConvTranspose3d -> BatchNorm3d -> subtract the
    per-(sample, channel) spatial mean, with the same state-dict keys."""

    def __init__(self, geom: ConvGeometry):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(
            geom.in_channels, geom.out_channels, geom.kernel_size, stride=geom.stride,
            padding=geom.padding, output_padding=geom.output_padding, groups=geom.groups,
            bias=geom.bias, dilation=geom.dilation)
        self.batch_norm = nn.BatchNorm3d(geom.out_channels)

    def forward(self, x):
        x = self.batch_norm(self.conv_transpose(x))
        return x - x.mean(dim=(2, 3, 4), keepdim=True)


class PipelineModel(ReferenceModel):
    """The same modules run by ``Pipeline.from_modules(conv, bn)``: ``ModelNew`` for any geometry."""

    def __init__(self, geom: ConvGeometry):
        super().__init__(geom)
        from numba_deconv import Pipeline

        # The pipeline holds references to the two modules, never copies of them.
        self.pipeline = Pipeline.from_modules(self.conv_transpose, self.batch_norm)

    def forward(self, x):
        return self.pipeline.train(self.training)(x)


def cache(clear: bool = False) -> int:
    """``cache``: the kernel cache's place, entries and size (and ``--clear``)."""
    from numba_deconv.kernels import disk_cache

    if clear:
        print(f"removed {disk_cache.clear()} files from {disk_cache.directory()}")
    state = "on" if disk_cache.enabled() else f"off ({disk_cache.ENV_ENABLED}=0)"
    print(f"kernel cache: {disk_cache.directory()} ({state}), {len(disk_cache.entries())} "
          f"kernels, {disk_cache.size_bytes() / 1e6:.1f} MB")
    return 0


# ---- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands = _parsers()
    if not argv or _is_run_option(commands["run"], argv[0]):
        argv = ["run", *argv]
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("no command given")
    if args.command == "cache":
        return cache(clear=args.clear)
    if args.command == "bench" and args.rows is not None:
        from numba_deconv import bench

        if not args.suite:
            commands["bench"].error("--rows selects rows of the suite: give --suite too")
        try:
            bench.select_cases(args.rows)
        except ValueError as err:
            commands["bench"].error(f"--rows: {err}")
    if args.command == "bench" and args.first_call:
        from numba_deconv import bench, first_call

        if bench.is_simulator() or not bench.torch.cuda.is_available():
            print("bench: timing first calls needs a GPU (running under the CUDA simulator); "
                  "nothing timed.")
            return 2
        first_call.measure(args.out)
        return 0
    if args.command == "bench" and args.ddp:
        from numba_deconv import bench, bench_ddp

        if bench.is_simulator() or not bench.torch.cuda.is_available():
            print("bench: timing DDP training steps needs a GPU (running under the CUDA "
                  "simulator); nothing timed.")
            return 2
        return bench_ddp.measure(args.out)
    if args.command == "bench":
        from numba_deconv import bench

        # ``suite`` (and ``rows``) are passed only when asked for, so bench.main without them
        # still works.
        extra = {"suite": True} if args.suite else {}
        if args.rows is not None:
            extra["rows"] = args.rows
        return bench.main(args.out, tiny=args.tiny, geometry=args.geometry, sweep=args.sweep,
                          reps=args.reps, **extra)

    command = commands[args.command]
    explaining = args.command == "explain"
    try:
        problem = problem_from_args(args, reduce=not explaining and is_simulator(),
                                    training=not explaining or args.mode == "train")
    except (ValueError, TypeError) as err:
        command.error(str(err))
    if explaining:
        if args.generic and args.variance == "gram":
            command.error("--variance gram runs the specialised kernels: not with --generic")
        if args.variance == "gram":
            from numba_deconv.gram_plan import gram_fits
            from numba_deconv.pipeline import GRAM_ITEMSIZE

            if not gram_fits(problem.geometry, GRAM_ITEMSIZE):  # the sums are float64
                command.error("--variance gram: this geometry's Gram tiles do not fit shared "
                              "memory (too many input channels for its offsets)")
    # a problem the kernels' launches or the device's memory cannot hold (a grid past the
    # launch limit, say) is the caller's to change: a usage error, not a traceback
    import torch

    try:
        if explaining:
            return explain(problem, args.mode, measure=args.measure, variance=args.variance,
                           specialize=not args.generic)
        return run(args.reps, problem)
    except (ValueError, torch.OutOfMemoryError) as err:
        command.error(f"this problem cannot run here: {err}")


# ---- run --------------------------------------------------------------------------------------
def run(reps: int = RUN_REPS, problem: Problem | None = None) -> int:
    """Check ``problem`` (default: the default problem, reduced under the simulator) in train
    then eval mode against PyTorch in float64 and time it; 0 only when every relative error is
    within ``RUN_RTOL``."""
    import torch

    from numba_deconv import ModelNew
    from numba_deconv.bench import randomize_batch_norm, time_gpu
    from numba_deconv import tensor_device
    from numba_deconv.testing import relative_error

    sim = is_simulator()
    device = tensor_device()
    problem = problem or default_problem(sim)
    geom, shape, dtype = problem.geometry, problem.input_shape, problem.torch_dtype()
    if sim:
        what = ("reduced problem" if problem.reduced
                else "the problem as given (large shapes take long)")
        print(f"CUDA simulator (no GPU): {what}, {problem.describe()}; "
              f"timings are CPU wall clock of the simulator.")
    else:
        print(f"GPU: {torch.cuda.get_device_name()}")
        print(f"problem: {problem.describe()}")
    if problem.custom:
        label = "Pipeline"
        print("checking Pipeline.from_modules(conv, bn) against PyTorch")

        def make_base():
            return ReferenceModel(geom)

        def make_new():
            return PipelineModel(geom)
    else:
        label = "ModelNew"
        print("checking ModelNew against PyTorch")
        init = (geom.in_channels, geom.out_channels, geom.kernel_size, geom.stride, geom.padding)

        def make_base():
            return reference.Model(*init, bias=geom.bias)

        def make_new():
            return ModelNew(*init, bias=geom.bias)

    torch.manual_seed(0)
    base = make_base()
    randomize_batch_norm(base.batch_norm)  # so eval mode exercises gamma, beta, running stats
    base = base.to(device=device, dtype=dtype)
    x = torch.randn(shape, device=device, dtype=dtype)
    failures = []

    for mode in ("train", "eval"):
        training = mode == "train"
        ref = copy.deepcopy(base).train(training)
        ref64 = copy.deepcopy(base).double().train(training)
        new = make_new().to(device=device, dtype=dtype)
        new.load_state_dict(base.state_dict())
        new.train(training)
        with torch.no_grad():
            out = new(x)
            expected = ref64(x.double())
        print(f"[{mode}] input {tuple(x.shape)} -> output {tuple(out.shape)} ({out.dtype})")
        errors = {"output": relative_error(out, expected)}
        precision = new.pipeline.conv_precision(x.shape, x.dtype, x.device)
        bounds = {"output": RUN_TF32_RTOL if precision == "tf32" else RUN_RTOL}
        max_abs = (out.double() - expected).abs().max().item()
        print(f"[{mode}] output vs PyTorch float64: max abs error {max_abs:.3e}, "
              f"relative error {errors['output']:.3e}"
              + (" (convolution in TF32, as PyTorch's)" if precision == "tf32" else ""))
        if training:
            for name in ("running_mean", "running_var"):
                errors[name] = relative_error(getattr(new.batch_norm, name),
                                              getattr(ref64.batch_norm, name))
            batches = int(new.batch_norm.num_batches_tracked)
            if batches != int(ref64.batch_norm.num_batches_tracked):
                failures.append(f"[{mode}] num_batches_tracked {batches} != "
                                f"{int(ref64.batch_norm.num_batches_tracked)}")
            print(f"[{mode}] running_mean relative error {errors['running_mean']:.3e}, "
                  f"running_var relative error {errors['running_var']:.3e}, "
                  f"num_batches_tracked {batches}")
        for name, err in errors.items():
            bound = bounds.get(name, RUN_RTOL)
            if not err <= bound:  # NaN fails too
                failures.append(f"[{mode}] {name} relative error {err:.3e} > {bound:.0e}")

        with torch.no_grad():
            if sim:
                t0 = time.perf_counter()
                new(x)
                t_new = time.perf_counter() - t0
                t0 = time.perf_counter()
                ref(x)
                t_ref = time.perf_counter() - t0
                print(f"[{mode}] time (simulator, CPU wall clock, 1 call): {label} "
                      f"{t_new:.3f} s, PyTorch eager (CPU) {t_ref * 1e3:.3f} ms")
            else:
                torch.backends.cudnn.allow_tf32 = True  # PyTorch's default, made explicit
                t_new = time_gpu(lambda: new(x), warmup=5, reps=reps)
                t_ref = time_gpu(lambda: ref(x), warmup=5, reps=reps)
                conv_kind = "TF32 conv" if dtype == torch.float32 else "float64"
                print(f"[{mode}] time (median of {reps} CUDA-event timings): {label} "
                      f"{t_new.median_ms:.3f} ms ({t_new.p10_ms:.3f}-{t_new.p90_ms:.3f}), "
                      f"PyTorch eager ({conv_kind}) {t_ref.median_ms:.3f} ms "
                      f"({t_ref.p10_ms:.3f}-{t_ref.p90_ms:.3f}): "
                      f"{t_ref.median_ms / t_new.median_ms:.2f}x")
        del out, expected

    if failures:
        for f in failures:
            print(f"FAIL: {f}", file=sys.stderr)
        return 1
    print("OK: every relative error is within its bound")
    return 0


# ---- explain ------------------------------------------------------------------------------------
def explain(problem: Problem | None = None, mode: str = "train", *, measure: bool = False,
            variance: str = "auto", specialize: bool = True) -> int:
    """Print ``Pipeline.explain`` for ``problem`` (default: the default problem) in ``mode``."""
    from numba_deconv import Pipeline
    from numba_deconv import tensor_device

    problem = problem or default_problem(False)
    dtype = problem.torch_dtype()
    model = ReferenceModel(problem.geometry).to(device=tensor_device(), dtype=dtype)
    pipe = Pipeline.from_modules(model.conv_transpose, model.batch_norm, variance=variance,
                                 specialize=specialize)
    pipe.train(mode == "train")
    print(pipe.explain(problem.input_shape, dtype=dtype, measure=measure))
    return 0


if __name__ == "__main__":
    sys.exit(main())
