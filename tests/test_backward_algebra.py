"""The backward of docs/design.md §2.8, checked in float64 against torch.autograd.

Every formula of §2.8 is evaluated here with plain torch code (no kernels) and compared with
what autograd computes through the reference operator (``numba_deconv.reference.Model``, its
convolution swapped for one of the geometry under test), in float64 on the CPU:

* the projection's backward: the gradient at batch norm's output is ``g`` centred per (n, c);
* ``dL/dy`` in evaluation (running statistics) and with batch statistics (training, and
  evaluation without running statistics), and the per-channel sum that remains of batch norm's
  two reductions (the other one, ``sum h``, is zero);
* the convolution bias and batch norm's beta have zero gradient, to float64 rounding of the
  sums autograd adds;
* ``dL/dgamma`` as ``A_c / sigma_c`` and as the contraction ``<w_c, V_c>`` of the weights with the
  weight gradient of the centred ``g`` (no division by gamma: a zero gamma is tested);
* ``dL/dx`` as a strided convolution (``F.conv3d`` with the same weight, stride, padding,
  dilation and groups) and as a gather over the phase classes of ``AxisGeometry.phase_taps``;
* ``dL/dW`` as a per-tap reduction over batch and the input box of ``AxisGeometry.box``;
* SyncBatchNorm semantics: per rank ``sum_dy`` is zero and ``sum_dy_xmu`` is the local ``A_c``,
  whose all-reduced sum gives every rank's ``dL/dy``.

Inputs carry a per-channel offset and the incoming gradient a per-(n, c) and per-channel offset,
so that centring matters; no parameter, statistic or gradient is zero unless a test says so.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from numba_deconv.geometry import AxisGeometry, ConvGeometry
from numba_deconv.reference import Model

DT = torch.float64
EPS = 1e-3  # batch norm's eps, large enough that leaving it out would show
RTOL = 1e-10  # relative error (norm of the difference over norm of the reference)
ZERO_RTOL = 1e-12  # a gradient that is zero in exact arithmetic, over the scale of its terms
SPATIAL = (2, 3, 4)


@dataclass(frozen=True)
class Geometry:
    batch: int
    in_channels: int
    out_channels: int
    kernel: int | tuple[int, int, int]
    stride: int | tuple[int, int, int]
    padding: int | tuple[int, int, int]
    output_padding: int | tuple[int, int, int]
    dilation: int | tuple[int, int, int]
    groups: int
    size: tuple[int, int, int]

    def conv(self, bias: bool) -> ConvGeometry:
        return ConvGeometry.create(self.in_channels, self.out_channels, self.kernel, stride=self.stride,
                                   padding=self.padding, output_padding=self.output_padding,
                                   groups=self.groups, bias=bias, dilation=self.dilation)


GEOMETRIES = [
    pytest.param(Geometry(2, 3, 4, 3, 2, 1, 0, 1, 1, (3, 4, 5)), id="stride2"),
    # output padding >= stride (allowed because it is below the dilation): conv3d of dL/dy
    # returns one more input row, which the input gradient drops
    pytest.param(Geometry(2, 2, 3, 3, 1, 2, 1, 2, 1, (4, 3, 4)), id="dilation2-outpad"),
    pytest.param(Geometry(3, 4, 6, 2, 2, 0, 1, 1, 2, (3, 3, 2)), id="groups2-outpad"),
    pytest.param(Geometry(2, 2, 4, (1, 2, 3), (1, 2, 3), (0, 1, 1), (0, 1, 2), (1, 1, 2), 2, (4, 3, 3)),
                 id="noncubic"),
    # stride 2 and dilation 2: phase 0 has no taps on any axis, its outputs are the bias alone
    pytest.param(Geometry(2, 2, 2, 3, 2, 3, 1, 2, 1, (4, 4, 4)), id="empty-phase"),
]

# "eval": running statistics; "train": batch statistics (and a running-statistics update that
# the backward does not see); "eval-untracked": evaluation without running statistics, which
# normalises with the batch's, so its backward is training's.
MODES = ["eval", "train", "eval-untracked"]


def chan(v: torch.Tensor) -> torch.Tensor:
    """A per-channel vector (C,) as (1, C, 1, 1, 1)."""
    return v.view(1, -1, 1, 1, 1)


@dataclass
class Problem:
    geom: Geometry
    mode: str
    bias: bool
    affine: bool
    model: Model
    x: torch.Tensor  # the input, with its autograd gradient in x.grad
    y: torch.Tensor  # conv_transpose3d(x, w) + b, with y.grad = dL/dy from autograd
    z: torch.Tensor  # batch norm's output, with z.grad
    g: torch.Tensor  # dL/d out
    weight: torch.Tensor
    gamma: torch.Tensor  # ones when affine=False
    m: torch.Tensor  # per-(n, c) spatial mean of y, (N, C, 1, 1, 1)
    mu: torch.Tensor  # per-channel batch mean of y, (C,)
    sigma: torch.Tensor  # sqrt(var + eps), running or batch variance as the mode uses, (C,)
    batch_stats: bool

    @property
    def conv(self) -> nn.ConvTranspose3d:
        return self.model.conv_transpose

    @property
    def bn(self) -> nn.BatchNorm3d:
        return self.model.batch_norm

    @property
    def centred_g(self) -> torch.Tensor:
        return self.g - self.g.mean(SPATIAL, keepdim=True)

    @property
    def count(self) -> int:
        """M = N * S, the values behind each batch statistic."""
        return self.y.numel() // self.y.shape[1]


def _random(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=DT)


def _uniform(gen: torch.Generator, lo: float, hi: float, *shape: int) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=DT)


def _signs(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).to(DT)


def build(geom: Geometry, mode: str, bias: bool, affine: bool, zero_gamma: bool = False) -> Problem:
    """Run the reference operator forward and backward in float64 on random, non-trivial values."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((geom, mode, bias, affine, zero_gamma)).encode()))
    ci, co = geom.in_channels, geom.out_channels
    model = Model(ci, co, geom.kernel, geom.stride, geom.padding, bias=bias)
    model.conv_transpose = nn.ConvTranspose3d(
        ci, co, geom.kernel, stride=geom.stride, padding=geom.padding, output_padding=geom.output_padding,
        groups=geom.groups, bias=bias, dilation=geom.dilation)
    model.batch_norm = nn.BatchNorm3d(co, eps=EPS, affine=affine, track_running_stats=mode != "eval-untracked")
    model = model.to(DT).train(mode == "train")
    conv, bn = model.conv_transpose, model.batch_norm
    with torch.no_grad():
        conv.weight.copy_(_random(gen, *conv.weight.shape))
        if bias:
            conv.bias.copy_(_random(gen, co) + 2.0)
        if affine:
            bn.weight.copy_(_signs(gen, co) * _uniform(gen, 0.5, 1.5, co))
            if zero_gamma:
                bn.weight[0] = 0.0
            bn.bias.copy_(_random(gen, co) + 1.0)
        if bn.track_running_stats:
            bn.running_mean.copy_(_random(gen, co))
            bn.running_var.copy_(_uniform(gen, 0.5, 2.0, co))

    x = (_uniform(gen, 0.5, 1.5, geom.batch, ci, *geom.size)
         * _random(gen, geom.batch, ci, *geom.size)
         + chan(_signs(gen, ci) * _uniform(gen, 2.0, 4.0, ci))).requires_grad_()
    kept: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, inputs, output):
            output.retain_grad()
            kept[name] = output
        return hook

    hooks = [conv.register_forward_hook(keep("y")), bn.register_forward_hook(keep("z"))]
    try:
        out = model(x)
    finally:
        for h in hooks:
            h.remove()
    n, _, *spatial = out.shape
    g = (_random(gen, *out.shape) + _uniform(gen, -3.0, 3.0, n, co, 1, 1, 1)
         + chan(_uniform(gen, -2.0, 2.0, co)))
    (out * g).sum().backward()

    y = kept["y"]
    yd = y.detach()
    mu = yd.mean((0, *SPATIAL))
    batch_stats = mode != "eval"
    var = ((yd - chan(mu)) ** 2).mean((0, *SPATIAL)) if batch_stats else bn.running_var.detach()
    gamma = bn.weight.detach() if affine else torch.ones(co, dtype=DT)
    return Problem(geom, mode, bias, affine, model, x, y, kept["z"], g, conv.weight.detach(), gamma,
                   yd.mean(SPATIAL, keepdim=True), mu, torch.sqrt(var + EPS), batch_stats)


_CACHE: dict[tuple, Problem] = {}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tensors are tiny: one thread is faster than a pool's hand-offs (and than contending
    with whatever else the host runs). Restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=[True, False], ids=["affine", "no-affine"])
def affine(request) -> bool:
    return request.param


@pytest.fixture(params=[True, False], ids=["bias", "no-bias"])
def bias(request) -> bool:
    return request.param


@pytest.fixture(params=MODES)
def mode(request) -> str:
    return request.param


@pytest.fixture(params=GEOMETRIES)
def geom(request) -> Geometry:
    return request.param


@pytest.fixture
def problem(geom, mode, bias, affine) -> Problem:
    key = (geom, mode, bias, affine)
    if key not in _CACHE:
        _CACHE[key] = build(*key)
    return _CACHE[key]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def grad_y(p: Problem) -> torch.Tensor:
    """dL/dy of §2.8: k1 * centre(g) in evaluation; minus k2 * (y - mu) with batch statistics."""
    k1 = chan(p.gamma / p.sigma)
    dy = k1 * p.centred_g
    if p.batch_stats:
        a = (p.g * (p.y.detach() - p.m)).sum((0, *SPATIAL))  # A_c, the one remaining reduction
        k2 = chan(p.gamma * a / (p.count * p.sigma ** 3))
        dy = dy - k2 * (p.y.detach() - chan(p.mu))
    return dy


# ---- tap windows: the phase classes of §2.6, read in the backward's direction ----------------

def tap_windows(axis: AxisGeometry, in_size: int, out_size: int) -> dict[int, tuple | None]:
    """Per tap k of one axis: ``(phase r, input slice, output slice)`` pairing each input ``i``
    with the output ``o = s*i - p + d*k`` its tap reaches, or None where no input's tap lands
    inside the output. Built from the phase table: tap k of phase r reads outputs ``s*q + r``
    from inputs ``i = q + delta``, i.e. input i reads output ``s*(i - delta) + r``."""
    s = axis.stride
    windows: dict[int, tuple | None] = {}
    for r, taps in enumerate(axis.phase_taps()):
        quotients = len(range(r, out_size, s))  # outputs of phase r
        for k, delta in taps:
            q_lo, q_hi = max(0, -delta), min(quotients - 1, in_size - 1 - delta)
            box = axis.box(k, in_size)
            if q_lo > q_hi:
                assert box[0] > box[1], (k, box)
                windows[k] = None
                continue
            # the inputs of the tap are exactly §2.3's box
            assert (q_lo + delta, q_hi + delta) == box, (k, box)
            windows[k] = (r, slice(q_lo + delta, q_hi + delta + 1), slice(r + s * q_lo, r + s * q_hi + 1, s))
    assert sorted(windows) == list(range(axis.kernel))  # every tap in exactly one phase class
    return windows


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(N, C, ...) as (N, groups, C // groups, ...)."""
    return t.reshape(t.shape[0], groups, t.shape[1] // groups, *t.shape[2:])


def _phase_tap_windows(geom: Geometry, in_spatial, out_spatial):
    """Yield ``(phase, (kd, kh, kw), input slices, output slices)``, phase class by phase class."""
    axes = geom.conv(True).axes()
    per_axis = [tap_windows(a, i, o) for a, i, o in zip(axes, in_spatial, out_spatial)]
    for phase in itertools.product(*(range(a.stride) for a in axes)):
        taps = [[k for k, win in w.items() if win is not None and win[0] == r] for w, r in zip(per_axis, phase)]
        for tap in itertools.product(*taps):
            wins = [w[k] for w, k in zip(per_axis, tap)]
            yield phase, tap, tuple(win[1] for win in wins), tuple(win[2] for win in wins)


def input_gradient_by_phase(dy: torch.Tensor, w: torch.Tensor, geom: Geometry) -> torch.Tensor:
    """dL/dx as a gather: input i of every phase class's taps reads dL/dy at ``s*i - p + d*k``."""
    n, ci, *in_spatial = (geom.batch, geom.in_channels, *geom.size)
    dx = torch.zeros(n, ci, *in_spatial, dtype=DT)
    dxg, dyg = _grouped(dx, geom.groups), _grouped(dy, geom.groups)
    wg = w.reshape(geom.groups, ci // geom.groups, *w.shape[1:])  # (G, IPG, OPG, kD, kH, kW)
    for _, (kd, kh, kw), i_sl, o_sl in _phase_tap_windows(geom, in_spatial, dy.shape[2:]):
        dxg[(..., *i_sl)] += torch.einsum("ngodhw,gio->ngidhw", dyg[(..., *o_sl)], wg[..., kd, kh, kw])
    return dx


def weight_gradient_by_tap(x: torch.Tensor, dy: torch.Tensor, geom: Geometry) -> torch.Tensor:
    """dL/dW per tap: the sum over batch and the tap's input box of x (outer) dL/dy."""
    ci, co = geom.in_channels, geom.out_channels
    dw = torch.zeros(geom.groups, ci // geom.groups, co // geom.groups,
                     *geom.conv(True).kernel_size, dtype=DT)
    xg, dyg = _grouped(x, geom.groups), _grouped(dy, geom.groups)
    for _, (kd, kh, kw), i_sl, o_sl in _phase_tap_windows(geom, x.shape[2:], dy.shape[2:]):
        dw[..., kd, kh, kw] = torch.einsum("ngidhw,ngodhw->gio", xg[(..., *i_sl)], dyg[(..., *o_sl)])
    return dw.reshape(ci, co // geom.groups, *dw.shape[3:])


def contract_per_channel(w: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """``<w_c, v_c>``: sum over the input channels of c's group and the taps, per output channel."""
    ci, opg = w.shape[:2]
    prod = (w * v).reshape(groups, ci // groups, opg, -1)
    return prod.sum((1, 3)).reshape(groups * opg)


# ---- the tests ---------------------------------------------------------------------------------

def test_reference_forward_is_the_operator(problem):
    """The hooked model is the operator of §1 with the statistics the tests use."""
    p = problem
    out = p.z.detach() - p.z.detach().mean(SPATIAL, keepdim=True)
    want = chan(p.gamma / p.sigma) * (p.y.detach() - p.m)  # §2.1
    assert rel_err(out, want) < RTOL


def test_projection_backward_centres_g(problem):
    """The mean subtraction's backward: the gradient at batch norm's output is g centred per (n, c)."""
    assert rel_err(problem.z.grad, problem.centred_g) < RTOL


def test_grad_y(problem):
    """dL/dy through batch norm and the mean subtraction, against autograd's y.grad."""
    assert rel_err(grad_y(problem), problem.y.grad) < RTOL


def test_conv_bias_and_beta_have_zero_gradient(problem):
    """Shifts cancel in the backward too: autograd's gradients of the conv bias and of beta are
    sums that are zero in exact arithmetic, so what it returns is rounding of their terms."""
    p = problem
    # sum over (n, o) of dL/dy: its terms k1 * g and, with batch statistics, k2 * (y - mu)
    k1 = (p.gamma / p.sigma).abs()
    bias_scale = k1 * p.g.abs().sum((0, *SPATIAL))
    if p.batch_stats:
        a = (p.g * (p.y.detach() - p.m)).sum((0, *SPATIAL))
        k2 = (p.gamma * a / (p.count * p.sigma ** 3)).abs()
        bias_scale = bias_scale + k2 * (p.y.detach() - chan(p.mu)).abs().sum((0, *SPATIAL))
    beta_scale = p.g.abs().sum((0, *SPATIAL))  # dL/dbeta = sum of centred g
    assert float(bias_scale.min()) > 1.0 and float(beta_scale.min()) > 1.0  # not vacuous
    if p.bias:
        assert (p.conv.bias.grad.abs() <= ZERO_RTOL * bias_scale).all(), (p.conv.bias.grad, bias_scale)
    if p.affine:
        assert (p.bn.bias.grad.abs() <= ZERO_RTOL * beta_scale).all(), (p.bn.bias.grad, beta_scale)
    # the derived dL/dy sums to zero per channel as well
    assert (grad_y(p).sum((0, *SPATIAL)).abs() <= ZERO_RTOL * bias_scale).all()


def test_batch_norm_reductions(problem):
    """With batch statistics batch norm's backward needs sum h and sum h*yhat per channel
    (h = gamma * centred g); the first vanishes, the second is gamma/sigma * A_c with four equal
    forms of A_c. The per-(n, c) mean of dL/dy is -k2 (m - mu): zero in evaluation only."""
    p = problem
    yd = p.y.detach()
    h = chan(p.gamma) * p.centred_g
    sums = (0, *SPATIAL)
    assert (h.sum(sums).abs() <= ZERO_RTOL * h.abs().sum(sums)).all()  # the vanished reduction
    a = (p.g * (yd - p.m)).sum(sums)
    for form in (p.centred_g * (yd - chan(p.mu)), p.centred_g * (yd - p.m), p.centred_g * yd):
        assert rel_err(form.sum(sums), a) < RTOL
    yhat = (yd - chan(p.mu)) / chan(p.sigma)
    assert rel_err((h * yhat).sum(sums), p.gamma / p.sigma * a) < RTOL

    mean_dy = p.y.grad.mean(SPATIAL, keepdim=True)
    if p.batch_stats:
        k2 = chan(p.gamma * a / (p.count * p.sigma ** 3))
        want = -k2 * (p.m - chan(p.mu))
        assert rel_err(mean_dy, want) < RTOL
        assert float(want.abs().max()) > 1e-6  # training's dL/dy is not centred per (n, c)
    else:
        assert float(mean_dy.abs().max()) <= ZERO_RTOL * float(p.g.abs().max() * (p.gamma / p.sigma).abs().max())


def test_grad_gamma(problem):
    """dL/dgamma = A_c / sigma_c in both modes, and A_c = <w_c, V_c> with V the weight gradient of
    the centred g: computed without y and without dividing by gamma."""
    p = problem
    a = (p.g * (p.y.detach() - p.m)).sum((0, *SPATIAL))
    v = weight_gradient_by_tap(p.x.detach(), p.centred_g, p.geom)
    assert rel_err(contract_per_channel(p.weight, v, p.geom.groups), a) < RTOL  # A_c without y
    if p.affine:  # affine=False has no gamma, but A_c still enters dL/dy with batch statistics
        assert rel_err(a / p.sigma, p.bn.weight.grad) < RTOL


def test_weight_gradient_of_centred_g(problem):
    """V (the weight gradient of the centred g): the per-tap reduction agrees with autograd through
    conv_transpose3d alone; in evaluation dL/dW = a_c * V (the scale folds as in §2.2)."""
    p = problem
    geo = p.geom.conv(p.bias)
    w = p.weight.clone().requires_grad_()
    y = F.conv_transpose3d(p.x.detach(), w, None, geo.stride, geo.padding, geo.output_padding, geo.groups,
                           geo.dilation)
    (y * p.centred_g).sum().backward()
    v = weight_gradient_by_tap(p.x.detach(), p.centred_g, p.geom)
    assert rel_err(v, w.grad) < RTOL
    if not p.batch_stats:
        scale = (p.gamma / p.sigma).reshape(p.geom.groups, 1, -1)  # per output channel (group, oc)
        folded = (v.reshape(p.geom.groups, p.geom.in_channels // p.geom.groups, -1, *v.shape[2:])
                  * scale[..., None, None, None]).reshape(v.shape)
        assert rel_err(folded, p.conv.weight.grad) < RTOL


def test_grad_x(problem):
    """dL/dx is conv3d of dL/dy with the same weight, stride, padding, dilation and groups
    (cropped to the input where output padding >= stride), and a gather over the phase classes."""
    p = problem
    geo = p.geom.conv(p.bias)
    dy = grad_y(p)
    strided = F.conv3d(dy, p.weight, None, geo.stride, geo.padding, geo.dilation, geo.groups)
    assert all(a >= b for a, b in zip(strided.shape[2:], p.geom.size))
    strided = strided[(..., *(slice(0, size) for size in p.geom.size))]
    assert rel_err(strided, p.x.grad) < RTOL
    assert rel_err(input_gradient_by_phase(dy, p.weight, p.geom), p.x.grad) < RTOL


def test_grad_weight(problem):
    """dL/dW: per tap, the reduction of x (outer) dL/dy over the batch and the tap's input box."""
    p = problem
    assert rel_err(weight_gradient_by_tap(p.x.detach(), grad_y(p), p.geom), p.conv.weight.grad) < RTOL


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_zero_gamma(mode):
    """gamma_c = 0: the output's channel is zero, so is dL/dy's, and dL/dgamma_c = A_c / sigma_c
    still holds (the formulas never divide by gamma)."""
    p = build(GEOMETRIES[0].values[0], mode, bias=True, affine=True, zero_gamma=True)
    assert float(p.gamma[0]) == 0.0
    assert float(p.y.grad[:, 0].abs().max()) == 0.0
    a = (p.g * (p.y.detach() - p.m)).sum((0, *SPATIAL))
    assert abs(float(a[0])) > 1e-3
    assert rel_err(a / p.sigma, p.bn.weight.grad) < RTOL
    assert rel_err(grad_y(p), p.y.grad) < RTOL


@pytest.mark.parametrize("geom", GEOMETRIES)
def test_sync_batch_norm_sums(geom):
    """SyncBatchNorm semantics, the batch split over ranks: each rank's sum_dy is zero (the centring
    is per sample), its sum_dy_xmu is its local A_c, and the all-reduced A_c (with the global
    count) gives every rank's dL/dy."""
    p = build(geom, "train", bias=True, affine=True)
    yd = p.y.detach()
    ranks = [slice(0, 1), slice(1, p.geom.batch)]
    sums = (0, *SPATIAL)
    local = []
    for r in ranks:
        cg = p.centred_g[r]
        sum_dy = cg.sum(sums)
        assert (sum_dy.abs() <= ZERO_RTOL * p.g[r].abs().sum(sums)).all()
        sum_dy_xmu = (cg * (yd[r] - chan(p.mu))).sum(sums)
        a_local = (p.g[r] * (yd[r] - p.m[r])).sum(sums)  # what each rank's epilogue reduces
        assert rel_err(sum_dy_xmu, a_local) < RTOL
        local.append(a_local)
    a = torch.stack(local).sum(0)  # the all-reduce
    k1 = chan(p.gamma / p.sigma)
    k2 = chan(p.gamma * a / (p.count * p.sigma ** 3))
    for r in ranks:
        dy = k1 * p.centred_g[r] - k2 * (yd[r] - chan(p.mu))
        assert rel_err(dy, p.y.grad[r]) < RTOL


def test_default_problem_counts():
    """The sizes §2.8's costs quote for the default problem."""
    geo = ConvGeometry.create(16, 32, 3, stride=2, padding=1)
    out = geo.output_spatial((16, 32, 32))
    assert out == (31, 63, 63)
    elements = 16 * 32 * out[0] * out[1] * out[2]
    assert elements == 62_995_968  # 63.0 M; 252 MB in float32
    assert geo.macs(16, (16, 32, 32)) == 3_329_687_552  # per convolution: forward, dL/dx, dL/dW
    assert 16 * 16 * 16 * 32 * 32 == 4_194_304  # x and dL/dx: 16.8 MB in float32
    assert geo.weight_shape() == (16, 32, 3, 3, 3)  # 13,824 weights; <w_c, V_c> is 432 MACs
