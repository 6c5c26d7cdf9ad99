"""Batch statistics synchronized across processes, checked against one process.

Each rank holds a slice of one batch (slices may differ in size, or be empty) and runs
``ModelNew`` with its batch statistics synchronized over the process group
(``numba_deconv.convert_sync``, ``nn.SyncBatchNorm``'s semantics): two training steps, then an
evaluation. Rank 0 gathers every rank's outputs and running statistics and compares them with
PyTorch's own modules holding the whole batch, in float64; the exit status is 0 on every rank
when all agree within 1e-10.

    torchrun --nproc-per-node 2 examples/sync_statistics.py                # GPUs: NCCL
    torchrun --nproc-per-node 3 examples/sync_statistics.py --sizes 2,0,1  # an empty slice
    NUMBA_DECONV_DEVICE=sim torchrun --nproc-per-node 2 examples/sync_statistics.py  # no GPU

The backend is NCCL with a GPU per rank (``cuda:LOCAL_RANK``), gloo under the CUDA simulator.
The backward of synchronized statistics is not built yet, so this checks the forward's
statistics, not DDP training.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import numba_deconv as nd
from numba_deconv import testing
from numba_deconv.reference import Model

IN, OUT, KERNEL, STRIDE, PADDING = 3, 4, (2, 3, 2), (1, 2, 2), (0, 1, 1)
SPATIAL = (2, 3, 3)
RTOL = 1e-10


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
    """(training, the whole batch) per step: two training steps, then an evaluation."""
    out = []
    for step, training in enumerate((True, True, False)):
        gen = torch.Generator().manual_seed(100 + step)
        out.append((training, torch.randn(total, IN, *SPATIAL, generator=gen,
                                          dtype=torch.float64) * 2 + 5))
    return out


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
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = nd.tensor_device()

    model = nd.ModelNew(IN, OUT, KERNEL, STRIDE, PADDING, conv_impl=args.conv_impl)
    model = model.double().to(device)
    model.load_state_dict(reference_model().state_dict())
    model.batch_norm.momentum = None
    nd.convert_sync(model)
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    outputs = []
    for training, x in batches(sum(sizes)):
        model.train(training)
        with torch.no_grad():
            outputs.append(model(x[lo:hi].to(device)).cpu())
    bn = model.batch_norm
    mine = (outputs, bn.running_mean.cpu(), bn.running_var.cpu(), int(bn.num_batches_tracked))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)

    ok = [True]
    if rank == 0:
        ref = reference_model()
        expected = []
        for training, x in batches(sum(sizes)):
            ref.train(training)
            with torch.no_grad():
                expected.append(ref(x))
        worst = 0.0
        for r, (outs, rm, rv, tracked) in enumerate(everyone):
            a, b = sum(sizes[:r]), sum(sizes[:r + 1])
            errors = [testing.relative_error(o, e[a:b]) for o, e in zip(outs, expected) if b > a]
            errors += [testing.relative_error(rm, ref.batch_norm.running_mean),
                       testing.relative_error(rv, ref.batch_norm.running_var)]
            worst = max(worst, *errors)
            ok[0] &= tracked == int(ref.batch_norm.num_batches_tracked)
        ok[0] &= worst <= RTOL
        print(f"{world} ranks, batch slices {sizes}: largest relative error against one process "
              f"{worst:.2e} ({'ok' if ok[0] else 'FAILED'})", flush=True)
    dist.broadcast_object_list(ok, src=0)
    dist.destroy_process_group()
    return 0 if ok[0] else 1


if __name__ == "__main__":
    sys.exit(main())
