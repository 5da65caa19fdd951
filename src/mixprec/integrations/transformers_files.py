"""The Hugging Face Trainer's checkpoint folders as :class:`~mixprec.integrations.transformers.MixprecTrainer`
reads them: the precision state's file name, a plain ``transformers.Trainer``'s checkpoint adopted
(:func:`adopt_plain_checkpoint`), and the best checkpoint's fp32 weights given to the masters after
``load_best_model_at_end`` (:func:`load_best_fp32`).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from mixprec.checkpoint.adopt import adopt_fp32_run
from mixprec.engine.mixed_precision import MixedPrecision

__all__ = ["PRECISION_STATE_NAME", "adopt_plain_checkpoint", "load_best_fp32"]

PRECISION_STATE_NAME = "mixprec_precision.pt"


def load_best_fp32(mp: MixedPrecision, folder: str) -> int:
    """After the Trainer's ``load_best_model_at_end``: it loaded ``folder``'s ``model.safetensors`` (the masters'
    fp32 values, as MixprecTrainer saves them) into the 16-bit params, whose masters would adopt only the
    rounding; each master takes its saved fp32 value instead (its param the same rounding) and the edit is not
    adopted again. Returns how many masters were set (0 without masters, or for a folder without that file: a
    peft adapter's). Host syncs: the copies."""
    path = os.path.join(folder, "model.safetensors")
    if not mp.masters.pairs or not os.path.isfile(path):
        return 0
    saved = load_file(path, device=str(mp.device))
    names = {}
    for name, p in mp.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    done = 0
    with torch.no_grad():
        for p, master in mp.masters.pairs:
            value = next((saved[n] for n in names.get(id(p), ()) if n in saved), None)
            if value is not None and value.shape == master.shape and value.dtype == torch.float32:
                master.copy_(value)
                p.copy_(master)
                done += 1
    mp.masters.record_versions()
    return done


def adopt_plain_checkpoint(mp: MixedPrecision, folder: str, *, steps: int) -> None:
    """Adopt the ``checkpoint-N`` ``folder`` of a plain ``transformers.Trainer`` (fp32 weights in
    ``model.safetensors`` or ``pytorch_model.bin``, ``optimizer.pt``; ``steps``: its optimizer steps) into ``mp``,
    converted to its policy as ``set_policy`` would (:func:`mixprec.checkpoint.adopt.adopt_fp32_run`: an
    ``"adopt-checkpoint"`` event); tied weights saved once take their twin's value. The Trainer loaded the
    scheduler and RNG states itself. ValueError for a folder without those files, or 16-bit weights."""
    names = [n for n in ("model.safetensors", "pytorch_model.bin", "optimizer.pt")
             if os.path.isfile(os.path.join(folder, n))]
    if "optimizer.pt" not in names or len(names) < 2:
        raise ValueError(f"resume_from_checkpoint={folder!r} has no {PRECISION_STATE_NAME} and not a plain Trainer's "
                         f"model weights and optimizer.pt (found {names}): MixprecTrainer resumes its own checkpoints "
                         "and adopts a transformers.Trainer's")
    path = os.path.join(folder, names[0])
    if names[0].endswith(".safetensors"):
        weights = load_file(path, device=str(mp.device))
    else:
        weights = torch.load(path, map_location=mp.device, weights_only=True)
    optimizer_state = torch.load(os.path.join(folder, "optimizer.pt"), map_location=mp.device, weights_only=True)
    adopt_fp32_run(mp, _with_tied(mp.module, weights), optimizer_state, steps=steps,
                   source=f"transformers.Trainer checkpoint {os.path.basename(os.path.normpath(folder))}")


def _with_tied(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``saved`` with each name it left out that shares its tensor with a saved name (tied weights, which
    ``save_pretrained`` writes once) given that name's value; other missing names stay missing (the load names them)."""
    own = module.state_dict(keep_vars=True)
    twins: dict[int, list[str]] = {}
    for name, tensor in own.items():
        twins.setdefault(id(tensor), []).append(name)
    out = dict(saved)
    for name, tensor in own.items():
        twin = next((n for n in twins[id(tensor)] if n in saved), None) if name not in saved else None
        if twin is not None:
            out[name] = saved[twin]
    return out
