"""Tiny models and the one-micro-batch loop that several test modules drive the engine with."""

import torch
from torch import nn


def _linear(n_in=4, n_out=1, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out)


def _one_step(mp, x, loss_of=lambda out: out.float().sum()):
    """One micro-batch through the engine: autocast forward, backward, step (None off a boundary)."""
    with mp.autocast():
        loss = loss_of(mp.model(mp.cast_inputs(x)))
    mp.backward(loss)
    return mp.step()
