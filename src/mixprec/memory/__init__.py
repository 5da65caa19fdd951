"""Memory of a training step, measured: the training state's bytes (per rank under FSDP2), bytes saved for
backward, peak live tensors, what a batch costs, and what to recompute (docs/memory.md).

    from mixprec.memory import saved_bytes, peak_live_bytes, resident_tensors, state_bytes
    print(state_bytes(mp.model, mp.optimizer).per_param)   # after a backward that follows a step
    with mp.autocast():
        loss, saved = saved_bytes(lambda: loss_fn(mp.model(x), y), exclude=mp.model.parameters())
    _, live = peak_live_bytes(lambda: train_step(x, y), "cpu", resident=list(resident_tensors(model, opt)))
"""

from mixprec.memory.batch_budget import BatchBudget, fit_batch_budget, parse_bytes
from mixprec.memory.live import PeakLive, peak_live_bytes, resident_tensors
from mixprec.memory.saved import SavedBytes, saved_bytes
from mixprec.memory.state import StateBytes, state_bytes

__all__ = ["saved_bytes", "SavedBytes", "peak_live_bytes", "PeakLive", "resident_tensors", "fit_batch_budget",
           "BatchBudget", "parse_bytes", "state_bytes", "StateBytes"]
