"""The small model the block-scaled tests train (tests/blockscale, tests/distributed): an input projection, ``n``
residual blocks in a ``nn.ModuleList`` (a transformer's layers, so NVFP4's bf16 tail is its last block) and a head
of 8 classes (8 outputs: not a multiple of NVFP4's 16x16 weight tiles, so the shape keeps it too). Importable under
torchrun through ``ranks.tests_on_path()``."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """16 inputs, ``n`` blocks of width ``d``, 8 outputs: under MXFP8 the ``2n`` block linears convert, under
    NVFP4 all but the last block's (its bf16 tail); the first and last linears are kept."""

    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)
