"""A DDP training step on one GPU and on several: ``bench --ddp`` (GPUs only).

Each rank holds a batch of one suite shape (``bench.suite_cases``: the default problem, and
batch 32 at 32 -> 64 channels) and runs training steps of the operator as a layer inside a
network: forward with an input that requires grad, backward of a fixed incoming gradient, an
SGD step. Two providers:

* ``numba_deconv``: the pipeline, its batch statistics synchronized over the ranks
  (``Pipeline.synchronize``), under ``DistributedDataParallel``;
* ``torch_eager``: ``nn.ConvTranspose3d`` -> ``nn.SyncBatchNorm`` -> minus the spatial mean
  (``convert_sync_batchnorm``), under ``DistributedDataParallel``.

On one GPU each is what a user trains there: the pipeline unsynchronized, eager with
``nn.BatchNorm3d``, no DDP. Every world size runs in new processes, one per GPU
(``torch.multiprocessing``, NCCL). Each configuration is timed both ways on rank 0 with CUDA
events around each step (``bench.time_back_to_back``, ``bench.time_kernelbench``), and
profiled for a few steps for the time NCCL's kernels take on the GPU (the collectives: the
statistics' exchanges and DDP's gradient all-reduce; on a rank that waits for another, the
wait counts).

Scaling efficiency is the step time on one GPU over the step time on W GPUs (the throughput of
W GPUs over W times one GPU's, at the same per-rank batch). It writes ``ddp.json`` and
``ddp.md`` and prints the table.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from . import bench

SHAPES = ("default", "b32_32to64")
PROVIDERS = ("numba_deconv", "torch_eager")
WARMUP, REPS, PROFILED = 10, 50, 10
LR = 1e-3


@dataclass
class DdpRow:
    """One (shape, provider, world size): rank 0's step times (ms, medians) both ways, the
    GPU time of NCCL kernels per step (ms), samples per second (the whole world's)."""

    shape: str
    provider: str
    world: int
    batch_per_rank: int
    b2b_ms: float
    kb_ms: float
    collectives_ms: float
    samples_per_s: float = field(init=False)

    def __post_init__(self):
        self.samples_per_s = self.world * self.batch_per_rank / self.b2b_ms * 1e3


def _case(name: str) -> bench.Case:
    return next(c for c in bench.suite_cases() if c.name == name)


def _build(provider: str, case: bench.Case, world: int, device) -> nn.Module:
    """The provider's model on ``device`` (same seed on every rank), DDP-wrapped when
    ``world`` > 1."""
    model, _ = case.build(device)
    if provider == "numba_deconv":
        model = bench.NumbaModel(model, conv_impl="gather")
        if world > 1:
            model.pipe.synchronize(dist.group.WORLD)
    elif world > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.train()
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    return model


def _step(model: nn.Module, x: torch.Tensor, g: torch.Tensor):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def call():
        optimizer.zero_grad(set_to_none=True)
        x.grad = None
        model(x).backward(g)
        optimizer.step()

    return call


def _collectives_ms(call, steps: int) -> float:
    """GPU time of NCCL kernels per step, from the profiler over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    # acc_events: a process profiles several configurations (otherwise each warns)
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(steps):
            call()
        torch.cuda.synchronize()
    total_us = 0.0
    for event in prof.key_averages():
        if "nccl" in event.key.lower():
            total_us += getattr(event, "device_time_total", None) or event.cuda_time_total
    return total_us / steps / 1e3


def _worker(rank: int, world: int, port: int, out_path: str) -> None:
    """One rank: every shape and provider at this world size; rank 0 writes the rows."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    rows = []
    for shape in SHAPES:
        case = _case(shape)
        for provider in PROVIDERS:
            torch.manual_seed(0)
            model = _build(provider, case, world, device)
            _, x = case.build(device, seed=1 + rank)
            x = x.requires_grad_(True)
            gen = torch.Generator().manual_seed(2 + rank)
            g = torch.randn(case.output_shape(), generator=gen).to(device)
            call = _step(model, x, g)
            b2b = bench.time_back_to_back(call, warmup=WARMUP, reps=REPS)
            kb = bench.time_kernelbench(call, warmup=WARMUP, reps=REPS)
            collectives = _collectives_ms(call, PROFILED) if world > 1 else 0.0
            rows.append(DdpRow(shape, provider, world, case.batch, b2b.median_ms, kb.median_ms,
                               collectives))
            if world > 1:
                dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump([asdict(r) for r in rows], f)
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world(world: int) -> list[DdpRow]:
    """Every row at ``world`` ranks, each in a new process on its own GPU."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(world, _free_port(), path), nprocs=world, join=True)
        with open(path) as f:
            rows = json.load(f)
    out = []
    for r in rows:
        r.pop("samples_per_s")
        out.append(DdpRow(**r))
    return out


def summarize(rows: list[DdpRow]) -> list[dict]:
    """Per (shape, provider, world > 1): the scaling efficiency both ways (one GPU's step time
    over this world's) and numba_deconv's speed-up over eager at the same world size."""
    by = {(r.shape, r.provider, r.world): r for r in rows}
    out = []
    for r in rows:
        if r.world == 1 or (r.shape, r.provider, 1) not in by:
            continue
        one = by[(r.shape, r.provider, 1)]
        eager = by.get((r.shape, "torch_eager", r.world))
        out.append(dict(shape=r.shape, provider=r.provider, world=r.world,
                        efficiency_b2b=one.b2b_ms / r.b2b_ms, efficiency_kb=one.kb_ms / r.kb_ms,
                        speedup_b2b=eager.b2b_ms / r.b2b_ms if eager else float("nan"),
                        speedup_kb=eager.kb_ms / r.kb_ms if eager else float("nan")))
    return out


def table(rows: list[DdpRow], summary: list[dict], device: str) -> str:
    """The markdown table ``ddp.md`` holds and the console shows."""
    eff = {(s["shape"], s["provider"], s["world"]): s for s in summary}
    lines = [f"DDP training step (forward, backward, SGD), {device}, float32, per-rank batch "
             f"of the suite shape; medians of {REPS} steps on rank 0; efficiency = one GPU's "
             "step time / this one's; x eager = eager's step time / this one's (same world).",
             "",
             "| shape | provider | GPUs | step b2b / KB (ms) | samples/s | NCCL ms/step "
             "| efficiency b2b / KB | x eager b2b / KB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        s = eff.get((r.shape, r.provider, r.world))
        e = f"{s['efficiency_b2b']:.0%} / {s['efficiency_kb']:.0%}" if s else "-"
        x = f"{s['speedup_b2b']:.2f} / {s['speedup_kb']:.2f}" if s else "-"
        lines.append(f"| {r.shape} | {r.provider} | {r.world} | {r.b2b_ms:.3f} / {r.kb_ms:.3f} "
                     f"| {r.samples_per_s:,.0f} | {r.collectives_ms:.3f} | {e} | {x} |")
    return "\n".join(lines)


def measure(out_dir: str, worlds: tuple[int, ...] = (1, 2)) -> int:
    """Run every world size the machine has GPUs for; write ``ddp.json`` and ``ddp.md``."""
    gpus = torch.cuda.device_count()
    worlds = tuple(w for w in worlds if w <= gpus)
    rows: list[DdpRow] = []
    for world in worlds:
        rows += run_world(world)
    summary = summarize(rows)
    device = f"{gpus} x {torch.cuda.get_device_name(0)}"
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(device=device, torch=torch.__version__, warmup=WARMUP, reps=REPS,
                profiled_steps=PROFILED, worlds=list(worlds))
    with open(os.path.join(out_dir, "ddp.json"), "w") as f:
        json.dump(dict(meta=meta, rows=[asdict(r) for r in rows], summary=summary), f, indent=1)
    text = table(rows, summary, device)
    with open(os.path.join(out_dir, "ddp.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    if len(worlds) < 2:
        print(f"bench --ddp: {gpus} GPU(s): no multi-GPU rows")
    return 0
