"""Training on several processes: DDP with synchronized batch statistics, checked against one.

Each rank holds a slice of one batch (slices may differ in size, or be empty) and trains
``ModelNew`` under ``DistributedDataParallel`` with its batch statistics synchronized over the
process group (``numba_deconv.convert_sync``, ``nn.SyncBatchNorm``'s semantics): two SGD steps
whose input requires grad, then an evaluation. A rank's loss is its share of the whole batch's
loss times the world size, since DDP averages the ranks' parameter gradients.

Rank 0 gathers what every rank saw and compares it with PyTorch's own modules
(``nn.ConvTranspose3d``, ``nn.BatchNorm3d``) training on the whole batch in one process, in
float64: each step's output slice, input gradient (the world size times the reference's: every
rank's loss reaches every input through the statistics), the parameters' gradients after DDP's
average, the running statistics and batch count, and the parameters after each step. The exit
status is 0 on every rank when all agree within 1e-10 (the shifts' gradients, zero in exact
arithmetic, within 1e-10 of the weight gradient's scale).

    torchrun --nproc-per-node 2 examples/train_ddp.py                # GPUs: NCCL
    torchrun --nproc-per-node 3 examples/train_ddp.py --sizes 2,0,1  # an empty slice
    NUMBA_DECONV_DEVICE=sim torchrun --nproc-per-node 2 examples/train_ddp.py  # no GPU: gloo

The backend is NCCL with a GPU per rank (``cuda:LOCAL_RANK``), gloo under the CUDA simulator.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import numba_deconv as nd
from numba_deconv import testing
from numba_deconv.reference import Model

IN, OUT, KERNEL, STRIDE, PADDING = 3, 4, (2, 3, 2), (1, 2, 2), (0, 1, 1)
SPATIAL = (2, 3, 3)
RTOL = 1e-10
ZERO_GRADIENTS = ("conv_transpose.bias", "batch_norm.bias")


def reference_model() -> Model:
    """The modules every rank (and the check) starts from: seeded, float64, momentum None."""
    torch.manual_seed(11)
    model = Model(IN, OUT, KERNEL, STRIDE, PADDING).double()
    model.batch_norm.momentum = None
    with torch.no_grad():
        model.batch_norm.weight.uniform_(0.5, 1.5)
        model.batch_norm.bias.normal_()
    return model


def batches(total: int):
    """(training, the whole batch, the loss's weights) per step: two training steps, then an
    evaluation. The input has an offset far larger than its spread."""
    out = []
    for step, training in enumerate((True, True, False)):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(total, IN, *SPATIAL, generator=gen, dtype=torch.float64) * 2 + 5
        out.append((training, x, torch.randn(total, OUT, 1, 1, 1, generator=gen,
                                             dtype=torch.float64)))
    return out


def train(model, steps, lo: int, hi: int, scale: float, device) -> list:
    """Every step on the slice ``lo:hi`` of the batches: (output, input gradient, parameter
    gradients, running statistics, batch count, parameters), on the CPU."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for training, x, weights in steps:
        model.train(training)
        x = x[lo:hi].to(device).requires_grad_(training)
        with torch.set_grad_enabled(training):
            out = model(x)
        grads = {}
        if training:
            optimizer.zero_grad()
            # the output's square, weighted per (n, c): its gradient differs in every voxel
            loss = (weights[lo:hi].to(device) * out * out).sum() * scale
            loss.backward()
            grads = {n: _copy(p.grad) for n, p in module.named_parameters()}
            optimizer.step()
        bn = module.batch_norm
        seen.append((_copy(out), None if x.grad is None else _copy(x.grad), grads,
                     _copy(bn.running_mean), _copy(bn.running_var),
                     int(bn.num_batches_tracked),
                     {n: _copy(p) for n, p in module.named_parameters()}))
    return seen


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy on the CPU (``.cpu()`` of a CPU tensor is the tensor itself, which later steps
    change)."""
    return t.detach().to("cpu", copy=True)


def compare(everyone, expected, sizes, world: int) -> dict:
    """The largest relative error of each quantity, over every rank and step, against the
    reference's."""
    worst: dict = {}

    def note(what: str, error: float) -> None:
        error = float("inf") if math.isnan(error) else error  # a NaN is the worst error
        worst[what] = max(worst.get(what, 0.0), error)

    for r, steps in enumerate(everyone):
        a, b = sum(sizes[:r]), sum(sizes[:r + 1])
        for mine, ref in zip(steps, expected):
            out, dx, grads, rm, rv, tracked, params = mine
            e_out, e_dx, e_grads, e_rm, e_rv, e_tracked, e_params = ref
            note("running statistics", max(testing.relative_error(rm, e_rm),
                                           testing.relative_error(rv, e_rv)))
            note("batch count", 0.0 if tracked == e_tracked else float("inf"))
            for n, p in params.items():
                note(f"parameter {n}", testing.relative_error(p, e_params[n]))
            if b > a:
                note("output", testing.relative_error(out, e_out[a:b]))
                if e_dx is not None:
                    note("input gradient", testing.relative_error(dx / world, e_dx[a:b]))
            scale = max(g.abs().max().item() for g in e_grads.values()) if e_grads else 1.0
            for n, g in grads.items():
                if n in ZERO_GRADIENTS:  # zero in exact arithmetic: against the others' scale
                    note(f"gradient {n}", (g - e_grads[n]).abs().max().item() / scale)
                else:
                    note(f"gradient {n}", testing.relative_error(g, e_grads[n]))
    return worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", help="per-rank batch sizes, comma separated (default 2 each)")
    parser.add_argument("--conv-impl", choices=("gather", "scatter"), default="gather")
    args = parser.parse_args(argv)
    gpu = not nd.simulator.is_simulator()
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [2] * world
    if len(sizes) != world:
        parser.error(f"--sizes has {len(sizes)} values for {world} ranks")
    local = int(os.environ.get("LOCAL_RANK", rank))
    if gpu:
        torch.cuda.set_device(local)
    device = nd.tensor_device()
    total = sum(sizes)
    steps = batches(total)

    model = nd.ModelNew(IN, OUT, KERNEL, STRIDE, PADDING, conv_impl=args.conv_impl)
    model = model.double().to(device)
    model.load_state_dict(reference_model().state_dict())
    model.batch_norm.momentum = None
    nd.convert_sync(model)
    model = DistributedDataParallel(model, device_ids=[local] if gpu else None)
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    mine = train(model, steps, lo, hi, world / total, device)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)

    ok = [True]
    if rank == 0:
        expected = train(reference_model(), steps, 0, total, 1.0 / total, "cpu")
        errors = compare(everyone, expected, sizes, world)
        worst = max(errors.values())
        ok[0] = worst <= RTOL
        print(f"{world} ranks, batch slices {sizes}: largest relative error against one process "
              f"{worst:.2e} ({'ok' if ok[0] else 'FAILED'})", flush=True)
        for what, error in errors.items():
            if error > RTOL:
                print(f"  {what}: {error:.2e}", flush=True)
    dist.broadcast_object_list(ok, src=0)
    dist.destroy_process_group()
    return 0 if ok[0] else 1


if __name__ == "__main__":
    sys.exit(main())
