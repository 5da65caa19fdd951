"""mixprec.memory.saved: bytes saved for backward, counted once per storage, parameters left out."""

import torch
from torch import nn

from mixprec.memory.saved import SavedTensorCounter, saved_bytes
from mixprec.memory.storages import StorageCounter


def test_fp32_linear_gelu_saves_input_and_preactivation_not_the_weight():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(16, 64)
    out, saved = saved_bytes(lambda: torch.nn.functional.gelu(lin(x)).sum(), exclude=lin.parameters())
    # Linear saves x (16x64 fp32) and its weight (a parameter: excluded); gelu saves its input (16x32 fp32).
    assert saved.total == 16 * 64 * 4 + 16 * 32 * 4
    assert saved.by_dtype == {"torch.float32": saved.total}
    out.backward()
    assert lin.weight.grad is not None


def test_autocast_bf16_weight_copy_is_counted_and_views_count_their_storage_once():
    lin = nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, requires_grad=True)  # its gradient needs the weight: the bf16 copy is saved
    with torch.autocast("cpu", torch.bfloat16):
        _, saved = saved_bytes(lambda: lin(x).float().sum(), exclude=lin.parameters())
    # autocast's bf16 copies of x and of the weight are saved: 2 bytes per element each.
    assert saved.by_dtype == {"torch.bfloat16": 16 * 64 * 2 + 32 * 64 * 2}
    big = torch.randn(8, 8, requires_grad=True)
    with SavedTensorCounter() as counter:
        (big[:4] * big[4:]).sum()
    # both factors are views of one 256-byte storage
    assert counter.result().total == 8 * 8 * 4 and counter.result().tensors == 2


def test_storage_counter_counts_once_and_skips_excluded():
    a = torch.zeros(10)
    counter = StorageCounter(exclude=[a])
    assert counter.add(a[2:]) == 0
    b = torch.zeros(3, dtype=torch.bfloat16)
    assert counter.add(b) == 6 and counter.add(b.view(3, 1)) == 0
