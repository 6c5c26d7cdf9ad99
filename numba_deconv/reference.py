"""The reference model: KernelBench level 2, problem 15, exactly as published.

``Model`` is what ``numba_deconv.ModelNew`` replaces; ``get_init_inputs()`` and ``get_inputs()``
follow the KernelBench convention and build the default problem:
batch 16, 16 -> 32 channels, input 16x32x32, kernel 3, stride 2, padding 1,
giving an output of shape (16, 32, 31, 63, 63).
"""

from __future__ import annotations

import torch
from torch import nn

batch_size = 16
in_channels = 16
out_channels = 32
depth, height, width = 16, 32, 32
kernel_size = 3
stride = 2
padding = 1


class Model(nn.Module):
    """ConvTranspose3d -> BatchNorm3d -> subtract the per-(sample, channel) spatial mean."""

    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, bias=True):
        super().__init__()
        self.conv_transpose = nn.ConvTranspose3d(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=bias
        )
        self.batch_norm = nn.BatchNorm3d(out_channels)

    def forward(self, x):
        x = self.conv_transpose(x)
        x = self.batch_norm(x)
        return x - torch.mean(x, dim=(2, 3, 4), keepdim=True)


def get_inputs(device: str | torch.device = "cpu"):
    """One random input batch for the default problem (KernelBench convention)."""
    return [torch.randn(batch_size, in_channels, depth, height, width, device=device)]


def get_init_inputs():
    """Constructor arguments of ``Model`` for the default problem."""
    return [in_channels, out_channels, kernel_size, stride, padding]
