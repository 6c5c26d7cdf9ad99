"""``Pipeline.explain``: stage rows, napkin math, rendering; GPU resources and timings when marked."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import numba_deconv as nd
from numba_deconv.plan import Options
from numba_deconv import planner
from numba_deconv.explain import (DEVICE_PEAKS, Candidate, _forced, _resources, device_peaks,
                                  explain, theoretical_occupancy)
from numba_deconv import tensor_device


SHAPE = (2, 3, 3, 4, 5)
HOST_KERNELS = ("host", "torch", "fused")  # stages that are not numba launches of their own


def make_pipe(conv_impl: str, training: bool, dtype=torch.float32, **conv_kwargs):
    """``conv_impl`` "gram": the gather with training's variance from the Gram sums."""
    kwargs = dict(kernel_size=3, stride=2, padding=1) | conv_kwargs
    conv = nn.ConvTranspose3d(3, 4, **kwargs).to(dtype=dtype, device=tensor_device())
    bn = nn.BatchNorm3d(4).to(dtype=dtype, device=tensor_device())
    variance = "gram" if conv_impl == "gram" else "epilogue"
    return nd.Pipeline.from_modules(conv, bn, conv_impl=conv_impl.replace("gram", "gather"),
                                    variance=variance).train(training)


@pytest.mark.parametrize("training", [True, False])
def test_the_generic_tier_says_so(training):
    """``specialize=False``: one run-time-geometry gather, the stored path's finish, and a note
    naming the tier (the specialised plan's note names its own)."""
    pipe = make_pipe("gather", training)
    generic = nd.Pipeline.from_modules(pipe.conv, pipe.bn, specialize=False).train(training)
    report = generic.explain(SHAPE)
    assert [r.stage for r in report.rows] == [s for s in generic.stages if s != "output"]
    assert report.rows[0].stage == "conv_transpose3d_gather_simple"
    assert report.rows[0].flops == 2 * generic.geometry.macs(SHAPE[0], SHAPE[2:])
    assert any(n.startswith("tier: generic") for n in report.notes)
    assert any(n.startswith("tier: specialised") for n in pipe.explain(SHAPE).notes)


def test_the_backward_input_gradients_split_says_so():
    """Where the backward's input-gradient kernel splits its output channels (few input
    positions for a long walk through the channels and taps), a note says into how many parts;
    where it does not (many positions, or few channels and taps), none does."""
    conv = nn.ConvTranspose3d(8, 64, 3, 2, 1).to(device=tensor_device())
    bn = nn.BatchNorm3d(64).to(device=tensor_device())
    pipe = nd.Pipeline.from_modules(conv, bn)
    notes = pipe.explain((1, 8, 2, 2, 2)).notes
    assert any("split into 16 parts of up to 4" in n for n in notes), notes
    assert not any("parts of up to" in n for n in pipe.explain((16, 8, 16, 32, 32)).notes)
    assert not any("parts of up to" in n for n in make_pipe("gather", True).explain(SHAPE).notes)


@pytest.mark.parametrize("conv_impl", ["gather", "torch", "scatter", "gram"])
@pytest.mark.parametrize("training", [True, False])
def test_rows_follow_stages_and_flops(conv_impl, training):
    pipe = make_pipe(conv_impl, training)
    report = pipe.explain(SHAPE)
    assert [r.stage for r in report.rows] == [s for s in pipe.stages if s != "output"]
    conv_stage = f"conv_transpose3d_{pipe.conv_impl}"
    macs = pipe.geometry.macs(SHAPE[0], SHAPE[2:])
    assert report.macs == macs
    conv = report.row(conv_stage)
    extra = 3 * report.output_shape[0] * 4 * (report.output_shape[2] * report.output_shape[3]
                                              * report.output_shape[4])
    assert conv.flops == 2 * macs + (extra if conv_impl == "gather" and training else 0)
    if conv_impl == "gram" and training:
        assert report.row("gram_sums").flops > 0 and report.row("gram_reduce").bytes > 0
    assert conv.kernel.startswith(conv_stage)
    for row in report.rows:  # every kernel stage has a launch shape and costs something
        if row.stage == "conv_transpose3d_torch":  # PyTorch's, not a numba launch
            assert row.grid is None and row.bytes > 0, row
        elif not row.kernel.startswith(HOST_KERNELS):
            assert row.block and row.grid and all(g >= 1 for g in row.grid), row
            assert row.bytes > 0, row
    text = str(report)
    for stage in pipe.stages[:-1]:
        assert stage in text
    assert "GFLOP" in text and "floor" in text
    json.dumps(report.to_dict())  # JSON-able


def test_floors_are_flops_over_peak_and_compulsory_bytes_over_bandwidth():
    pipe = make_pipe("gather", False)
    report = explain(pipe, SHAPE, peak_flops=1e12, bandwidth=1e11)
    x_bytes = 4 * SHAPE[0] * SHAPE[1] * 3 * 4 * 5
    out_bytes = 4 * report.output_shape[0] * 4 * 5 * 7 * 9
    w_bytes = 4 * 3 * 4 * 27
    assert report.output_shape == (2, 4, 5, 7, 9)
    assert report.compulsory_bytes == x_bytes + w_bytes + out_bytes
    assert report.arithmetic_floor_us == pytest.approx(2 * report.macs / 1e12 * 1e6)
    assert report.memory_floor_us == pytest.approx(report.compulsory_bytes / 1e11 * 1e6)
    # eval gather writes the output once: its bytes are the compulsory traffic plus the means
    assert report.row("conv_transpose3d_gather").bytes == report.compulsory_bytes + 2 * 4 * 8


def test_peaks_matched_by_name():
    assert device_peaks("NVIDIA H200")[0] == "H200"
    assert device_peaks("NVIDIA H100 80GB HBM3")[1] == DEVICE_PEAKS["H100"]
    assert device_peaks("NVIDIA H100 PCIe")[0] == "H100 PCIe"
    assert device_peaks("something else")[0] == "H100"
    pipe = make_pipe("gather", True)
    assert explain(pipe, SHAPE, device_name="NVIDIA H200").peaks["bandwidth"] == 4.8e12


def test_occupancy_arithmetic():
    hopper = {"regs": 65536, "threads": 2048, "shared": 233472, "sms": 132, "blocks": 32,
              "reserved_shared": 1024}
    # docs/design.md §6: a 144-register kernel at 128 threads: 3 blocks = 12 of 64 warps (~19%)
    assert theoretical_occupancy(144, 128, 2048, hopper) == pytest.approx(12 / 64)
    assert theoretical_occupancy(32, 256, 0, hopper) == 1.0
    # shared memory bound: 100 KB + 1 KB reserved per block -> 2 blocks of 8 warps
    assert theoretical_occupancy(32, 256, 100 * 1024, hopper) == pytest.approx(16 / 64)


def test_resources_count_dynamic_shared_memory():
    """A launch's dynamic shared memory (the gather's weights, gram_sums' tiles) counts with the
    kernel's static arrays, in the report and in the occupancy."""
    class Compiled:  # what numba's dispatcher answers, one signature
        overloads = {"sig": None}

        def get_regs_per_thread(self):
            return {"sig": 64}

        def get_shared_mem_per_block(self):
            return {"sig": 1536}

        def get_local_mem_per_thread(self):
            return {"sig": 0}

    hopper = {"regs": 65536, "threads": 2048, "shared": 233472, "sms": 132, "blocks": 32,
              "reserved_shared": 1024}
    regs, shared, local, occ = _resources(Compiled(), 192, hopper, 44960)
    assert (regs, shared, local) == (64, 1536 + 44960, 0)
    # 47.5 KB per block: 4 blocks of 6 warps by shared memory, where registers alone allow 5
    assert occ == pytest.approx(24 / 64)
    assert _resources(Compiled(), 192, hopper)[3] == pytest.approx(30 / 64)


def test_rejects_bad_shape_and_dtype():
    pipe = make_pipe("gather", False)
    with pytest.raises(ValueError, match="channels"):
        pipe.explain((2, 5, 3, 4, 5))
    with pytest.raises(TypeError, match="dtype"):
        pipe.explain(SHAPE, dtype=torch.float64)


@pytest.mark.sim
def test_simulator_says_which_columns_need_a_gpu():
    pipe = make_pipe("scatter", True)
    report = pipe.explain(SHAPE, measure=True)
    assert all(r.regs is None and r.occupancy is None and r.measured_us is None for r in report.rows)
    assert report.measured_us is None
    assert "need a GPU" in str(report)


@pytest.mark.gpu
@pytest.mark.parametrize("conv_impl", ["gather", "scatter", "gram"])
@pytest.mark.parametrize("training", [True, False])
def test_gpu_resources_and_timings(conv_impl, training):
    pipe = make_pipe(conv_impl, training)
    before = {k: v.clone() for k, v in pipe.bn.state_dict().items()}
    report = explain(pipe, (4, 3, 6, 8, 10), measure=True, repeats=5)
    for row in report.rows:
        if row.kernel.startswith(HOST_KERNELS):
            continue
        assert row.regs and row.regs > 0, row
        assert row.local_bytes is not None and row.shared_bytes is not None, row
        assert 0 < row.occupancy <= 1, row
        assert row.measured_us and row.measured_us > 0, row
    assert report.measured_us > 0
    assert "measured whole call" in str(report)
    for k, v in pipe.bn.state_dict().items():  # timing in training mode leaves the stats alone
        assert torch.equal(v, before[k]), k


def test_the_candidates_render():
    """The convolutions chosen among: each one's predicted cost, its measured one where timed,
    and which was chosen."""
    report = explain(make_pipe("gather", False), SHAPE)
    report.candidates = [Candidate("gather", "the gather (FFMA)", 120.0, False, 50.0, 71.5),
                         Candidate("gather_mma", "the gather on tensor cores (TF32)", 90.0, True)]
    text = str(report)
    assert "  the gather (FFMA): predicted 120.0; measured 50.0 + 71.5 = 121.5\n" in text + "\n"
    assert "  the gather on tensor cores (TF32): predicted 90.0  <- chosen" in text
    assert json.dumps(report.to_dict())


@pytest.mark.parametrize("kw, listed", [
    (dict(), {"gather", "gather_mma", "torch"}),
    (dict(conv_impl="gather"), {"gather", "gather_mma"}),
    (dict(precision="ieee"), {"gather", "gather_mma"}), (dict(precision="tf32"), set()),
    (dict(conv_impl="scatter"), set()), (dict(conv_impl="torch"), set()),
    (dict(precision="ieee", options=Options(split_tf32=True)), set()),
    (dict(dtype=torch.float64), set())],
    ids=["auto", "gather", "ieee", "tf32", "scatter", "torch", "split forced", "float64"])
def test_the_candidates_are_where_the_planner_chooses(kw, listed, monkeypatch):
    """The convolutions listed are those the pipeline's planner chooses among (on a CUDA
    device object under PyTorch's TF32 flag: nothing runs there): none where the convolution
    is asked for or float64 has one."""
    from numba_deconv import explain as explain_mod, precision

    monkeypatch.setattr(explain_mod, "tensor_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(planner, "peaks_of", lambda device: planner.DEVICE_PEAKS["H200"])
    monkeypatch.setattr(planner, "capability", lambda device: (9, 0))
    monkeypatch.setattr(precision, "torch_uses_tf32", lambda: True)
    dtype = kw.pop("dtype", torch.float32)
    conv = nn.ConvTranspose3d(16, 32, 3, stride=2, padding=1).to(dtype)
    pipe = nd.Pipeline(conv, nn.BatchNorm3d(32).to(dtype), **kw)
    shape = (16, 16, 16, 32, 32)
    got = explain_mod._candidates(pipe, shape, dtype, False, "gather_mma")
    assert {c.name for c in got} == listed
    assert all(c.predicted_us > 0 for c in got)
    assert [c.name for c in got if c.chosen] == (["gather_mma"] if listed else [])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", [None, "ieee"])
def test_measure_times_the_convolutions_chosen_among(precision):
    """``measure=True`` times every candidate of the planner's choice in both methods, on the
    pipeline's modules in its mode, and leaves the running statistics as they were; the one
    the call runs is marked."""
    device = tensor_device()
    conv = nn.ConvTranspose3d(16, 24, 3, stride=2, padding=1).to(device)
    bn = nn.BatchNorm3d(24).to(device)
    pipe = nd.Pipeline(conv, bn, precision=precision).train(True)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    shape = (2, 16, 5, 6, 7)
    report = explain(pipe, shape, measure=True, repeats=5)
    strict = bool(planner.tf32_refusal(torch.float32, device, precision))
    assert {c.name for c in report.candidates} == \
        ({"gather", "gather_mma"} if strict else {"gather", "gather_mma", "torch"})
    chosen = [c.name for c in report.candidates if c.chosen]
    assert chosen == [planner.convolution(pipe.geometry, shape, torch.float32, device,
                                          precision, True)[0]]
    assert all(c.predicted_us > 0 and c.b2b_us > 0 and c.kb_us > 0 for c in report.candidates)
    assert "<- chosen" in str(report)
    for c in report.candidates:   # each timed on a pipeline that runs it
        forced = _forced(pipe, c.name, strict)
        if c.name == "torch":
            assert forced.path(shape, torch.float32, device) == "torch"
        else:
            assert forced.tensor_cores(shape, torch.float32, device) == (c.name == "gather_mma")
            assert forced.mma_operand(shape, torch.float32, device) == (
                "" if c.name == "gather" else "tf32x3" if strict else "tf32")
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.gpu
def test_parameters_off_the_kernels_device_give_the_plan_and_say_why():
    # a pipeline of CPU modules on a GPU machine: explain cannot trace it (the kernels read the
    # parameters where they are), so it gives the plan without resources and says what to do
    pipe = nd.Pipeline(nn.ConvTranspose3d(4, 8, 3, 2, 1), nn.BatchNorm3d(8))
    report = explain(pipe, (1, 4, 3, 3, 3), measure=True)
    assert any("parameters are on cpu" in note and "measure=True ignored" in note
               for note in report.notes)
    assert report.rows and all(row.regs is None and row.measured_us is None for row in report.rows)


@pytest.mark.parametrize("second", [False, True])
def test_the_second_pass_in_the_plan(second):
    """Training on the tensor-core gather: with the output written by a second pass of the
    convolution, the gather's first pass stores nothing and the scale stage is the second
    pass; otherwise the gather stores the centred output and scale_rows scales it in place."""
    from numba_deconv.plan import Options

    conv = nn.ConvTranspose3d(3, 4, 3, stride=2, padding=1).to(tensor_device())
    bn = nn.BatchNorm3d(4).to(tensor_device())
    pipe = nd.Pipeline.from_modules(conv, bn, precision="tf32", specialize=True,
                                    options=Options(second_pass=second)).train(True)
    report = pipe.explain(SHAPE)
    gather, scale = report.row("conv_transpose3d_gather"), report.row("scale")
    out_bytes = 4 * math.prod(report.output_shape)
    if second:
        assert gather.kernel.endswith(",sums]") and scale.kernel.endswith(",rescaled]")
        assert scale.bytes > out_bytes > 0
        assert any("second pass of the convolution" in note for note in report.notes)
    else:
        assert gather.kernel.endswith(",train]") and scale.kernel.startswith("scale_rows")
        assert scale.bytes == 2 * out_bytes
