"""The operator's backward (docs/design.md §2.8) on the kernels: what ``autograd``'s op runs.

Given the incoming gradient ``g`` (the output's shape) and what the forward kept
(``Pipeline.forward_saving``), five launches at most:

1. ``grad_row_sums``: per (n, c) the sum of ``g`` (the projection's backward centres ``g`` by
   it) and, with batch statistics, ``sum_o g * (y - m)``, whose sum over the batch is ``A_c``;
   with batch statistics ``grad_coefficients`` then works out every per-channel and per-(n, c)
   constant of step 2 and ``dL/dgamma`` in float64, in one launch (in evaluation the host
   does, on per-channel tensors);
2. ``form_grad``: the gradient at the convolution's output, ``dy``, from ``g`` (and the kept
   convolution):

       evaluation:        dy = P g                   (the scale goes into the weights of step 3
                                                      and onto the weight gradient)
       batch statistics:  dy = k1_c * P g - k2_c * (y - mu_c)

3. ``input_grad``: ``dL/dx``, a convolution of ``dy`` with the weights (folded with
   ``k1 = gamma / sigma`` in evaluation);
4. ``weight_grad``: the weight gradient of ``dy``, a deterministic reduction over batch and
   space. In evaluation it is ``V`` (the weight gradient of ``P g``): ``dL/dW = k1 * V`` and
   ``A_c = <w_c, V_c>``, so evaluation never needs ``y``.

``dL/dgamma = A_c / sigma_c`` in both modes (no division by gamma: a zero gamma keeps its
gradient). The convolution's bias and batch norm's beta get zeros (``autograd``): the mean
subtraction removes both, exactly. Only what is asked for is computed (``needs``).

Synchronized batch statistics (``group``, ``sync``): ``dy`` is that of the loss of every rank,
so ``k2`` takes ``A_c`` and the count over the group (one ``all_gather``, ``sync.all_sums``,
whenever ``dL/dx`` or ``dL/dW`` is asked for; a rank with an empty slice still takes part).
``dL/dgamma`` stays the rank's own share, as ``nn.SyncBatchNorm``'s: data parallelism adds the
ranks' parameter gradients.
"""

from __future__ import annotations

import torch

from . import folding, sync
from .kernels import conv_grads, grad_rows


def backward(conv: tuple, g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
             gamma: torch.Tensor | None, yc: torch.Tensor, rows: torch.Tensor,
             stats: torch.Tensor, batch_stats: bool, needs: tuple[bool, bool, bool],
             group=None):
    """``(dL/dx, dL/dW, dL/dgamma)``, None where ``needs`` (x, weight, gamma) says not needed
    (``dL/dgamma`` also None without gamma). ``conv``: the convolution's (stride, padding,
    dilation, groups); ``yc``, ``rows``, ``stats``: as ``Pipeline.forward_saving`` returns
    them; ``group``: the process group of synchronized batch statistics, or None."""
    stride, padding, dilation, groups = conv
    need_x, need_w, need_gamma = needs
    need_gamma = need_gamma and gamma is not None
    batch, channels = g.shape[0], g.shape[1]
    f64 = dict(dtype=torch.float64, device=g.device)
    pooled = group is not None and batch_stats and (need_x or need_w)
    if batch == 0 or g.numel() == 0:
        if pooled:  # the other ranks' exchange waits for this rank's (empty) share
            sync.all_sums(0.0, torch.zeros(channels, **f64), group)
        return (torch.zeros_like(x) if need_x else None,
                torch.zeros_like(weight) if need_w else None,
                torch.zeros_like(gamma) if need_gamma else None)
    volume = g[0, 0].numel()
    r = batch * channels
    g = g.detach().contiguous()
    g_rows = g.view(r, volume)
    sigma = stats[2]
    gsum = torch.empty(r, **f64)
    dy = torch.empty_like(g)
    dgamma = None
    if batch_stats:
        y_rows = yc.view(r, volume)
        off, means = rows[0], rows[1]
        gy = torch.empty(r, **f64)
        grad_rows.launch_grad_row_sums(g_rows, gsum, y_rows, off.reshape(r), gy)
        totals = None
        if pooled:  # the group's count and A_c
            totals = sync.all_sums(batch * volume, gy.view(batch, channels).sum(dim=0), group)
        # dy = k1 (g - gm) - k2 (yc - off + m - mu): a = k1, e = -k2 and the per-(n, c)
        # constants b, worked out in one launch
        coef = torch.empty(2 * channels + r, **f64)
        a, e, b = coef[:channels], coef[channels:2 * channels], coef[2 * channels:]
        grad_gamma = None if gamma is None else torch.empty_like(gamma)  # A_c(local) / sigma
        grad_rows.launch_grad_coefficients(
            gsum.view(batch, channels), gy.view(batch, channels), off, means, stats,
            None if gamma is None else gamma.detach(), volume, batch * volume, a, e,
            b.view(batch, channels), grad_gamma, totals)
        dgamma = grad_gamma if need_gamma else None
        grad_rows.launch_form_grad(g_rows, a, b, dy.view(r, volume), y_rows, e)
        conv_weight = weight.detach()
    else:
        k1 = 1.0 / sigma if gamma is None else gamma.detach().to(torch.float64) / sigma
        grad_rows.launch_grad_row_sums(g_rows, gsum)
        ones = torch.ones(channels, **f64)
        grad_rows.launch_form_grad(g_rows, ones, -gsum / volume, dy.view(r, volume))
        conv_weight = folding.fold_weights(weight.detach(), k1, groups) if need_x else None
    dx = dw = None
    if need_x:
        dx = torch.empty_like(x)
        conv_grads.launch_input_grad(dy, conv_weight.contiguous(), dx, stride, padding, dilation)
    if need_w or (need_gamma and not batch_stats):
        v = torch.empty_like(weight)
        conv_grads.launch_weight_grad(x.detach().contiguous(), dy, v, stride, padding, dilation, groups)
        if batch_stats:
            dw = v
        else:
            # V: the weight gradient of P g; dL/dW = k1 * V, A_c = <w_c, V_c>
            dw = folding.fold_weights(v, k1, groups) if need_w else None
            if need_gamma:  # dL/dgamma = A_c / sigma, A_c = <w_c, V_c>
                dgamma = (_channel_dots(weight.detach(), v, groups) / sigma).to(gamma.dtype)
    return dx, dw, dgamma


def _channel_dots(w: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """``<w_c, V_c>`` per output channel c, in float64: (CI, OPG, k...) -> (groups * OPG,)."""
    ci, opg = w.shape[:2]
    prod = (w.to(torch.float64) * v.to(torch.float64)).view(groups, ci // groups, opg, -1)
    return prod.sum(dim=(1, 3)).reshape(groups * opg)
