"""What a new-user trial found in the bench, budget, checkpoint and policy messages (issues 27/28)."""

from __future__ import annotations

import pytest
import torch

from mixprec import Policy
from mixprec.policy.policy import PRESETS


@pytest.mark.parametrize("text", ["saved=fp32", "state=int8", " saved=compute , state=bf16"])
def test_a_policy_of_overrides_alone_is_refused_not_silently_fp32(text):
    with pytest.raises(ValueError, match=r"names no preset.*name a preset first, e.g. 'bf16-mixed,"):
        Policy.parse(text)


def test_a_policy_of_keys_that_set_the_precision_still_parses():
    assert Policy.parse("params=bf16,compute=bf16,master=fp32") == PRESETS["bf16-pure"]
    assert Policy.parse("compute=fp16").compute_dtype == torch.float16
    assert Policy.parse("fp32,state=int8").state_dtype == torch.int8     # a preset first: as before
    with pytest.raises(ValueError, match=r"rounding='up' is not allowed"):   # a bad value is named first
        Policy.parse("rounding=up")


# ------------------------------------------------------------------------------------------ memory_budget's words
def test_size_words_reads_in_the_unit_that_fits():
    from mixprec.engine.memory_budget import size_words

    assert [size_words(n) for n in (0, 512, 1023, 1024, 1536, 2**20, 13 * 2**20 + 2**20 * 2 // 5, 150 * 2**20,
                                    4 * 2**30, 2**40, None)] == \
        ["0 B", "512 B", "1023 B", "1 KiB", "1.5 KiB", "1 MiB", "13.4 MiB", "150 MiB", "4 GiB", "1 TiB", "unknown"]


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(d), torch.nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.fc(self.norm(x)))


class _Blocks(torch.nn.Module):
    def __init__(self, d: int = 16, n: int = 2) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(d) for _ in range(n))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).mean()


def _over_budget(checkpoint):
    """A 1 KiB budget (the fp32 params alone take more), two steps: the second is measured."""
    import warnings

    from mixprec import MixedPrecision
    from mixprec.engine.memory_budget import size_words
    from mixprec.optim import AdamW

    torch.manual_seed(0)
    model = _Blocks()
    mp = MixedPrecision(model, AdamW(model.parameters(), lr=1e-3), "bf16-mixed", device="cpu",
                        checkpoint=checkpoint, memory_budget="1KiB")
    assert "memory_budget 1 KiB: pending" in mp.decision
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with mp.autocast():
                loss = mp.model(torch.randn(4, 16))
            mp.backward(loss)
            mp.step()
    state = mp.state_dict()["memory_budget"]
    assert state["budget_bytes"] == 1024 and state["peak_bytes"] > 1024
    head = (f"memory_budget 1 KiB: peak {size_words(state['peak_bytes'])} is "
            f"{size_words(state['peak_bytes'] - 1024)} OVER the budget")
    warned = [str(w.message) for w in caught if "OVER the budget" in str(w.message)]
    assert len(warned) == 1 and head in warned[0] and head in mp.decision and "0.000977" not in mp.decision
    return mp.decision


def test_over_budget_without_recompute_suggests_it():
    assert 'to fit: checkpoint="auto" (recompute blocks in backward), a smaller batch, or a larger budget' in \
        _over_budget(None)


def test_over_budget_with_every_block_recomputed_in_full_does_not_suggest_recompute_again():
    decision = _over_budget("layers.*")
    assert 'checkpoint="auto"' not in decision
    assert ("to fit: a smaller batch or a larger budget (checkpoint='layers.*' already recomputes every one of its "
            "2 blocks in full)") in decision


def test_over_budget_with_selective_blocks_suggests_the_full_plan():
    decision = _over_budget("selective:layers.*")
    assert 'checkpoint="auto"' not in decision
    assert ("to fit: full recompute of the 2 of 2 blocks checkpoint='selective:layers.*' leaves selective or not "
            "recomputed (checkpoint='layers.*'), a smaller batch, or a larger budget") in decision
