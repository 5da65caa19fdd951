"""Write the old-checkpoint fixtures that tests/checkpoint/test_checkpoint_compat.py loads with the current code.

Run with the main of 2026-12-01 (fc21254, the flat package layout before issue 24), from a checkout of it::

    cd <checkout of fc21254> && PYTHONPATH=src python <this file> <this folder>

It writes, into the folder given (default: the folder of this file):

* ``bf16-pure/``, ``bf16-lean/``: one-process checkpoint roots (``save_checkpoint`` at steps 2 and 4;
  ``keep=2``: ``step-2``, ``step-4``, ``latest``; ``keep=1`` for bf16-lean: ``step-4``, ``latest``) of :func:`tiny_model` under ``bf16-pure`` with
  ``torch.optim.AdamW`` and under ``bf16-lean`` with ``mixprec.optim.AdamW`` (8-bit state); next to each,
  ``<name>.expected.pt``: the losses, model state and fp32 master values after loading ``latest`` into a
  fresh engine and continuing :data:`CONTINUE` steps on :func:`batches` (bit for bit).
* ``fsdp2/``: a DCP checkpoint root of a 2-process gloo run (``strategy="fsdp2"``, ``bf16-mixed``, SGD with
  momentum and a StepLR scheduler) saved at step :data:`DCP_SAVE_AT` (``keep=1``), and ``fsdp2.expected.pt``:
  the parameters at save, then the losses and parameters after loading it (old code) in one process and
  continuing :data:`CONTINUE` steps on the concatenated global batches, and after loading it at 2 ranks
  and continuing there.

The helpers below use only the public API, so the test imports them with the current code.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
import mixprec.optim
from mixprec import MixedPrecision

try:   # the layout after issue 24
    from mixprec.distributed import process as mpd
except ImportError:   # fc21254: one flat module
    import mixprec.distributed as mpd

WORLD, SAVES, CONTINUE, DCP_SAVE_AT = 2, (2, 4), 3, 3
ONE_PROCESS = {"bf16-pure": "torch", "bf16-lean": "mixprec"}   # policy -> whose AdamW
KEEP = {"bf16-pure": 2, "bf16-lean": 1}   # checkpoints kept (fixtures under 200 KB)


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def batches(n: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 8, generator=g)} for _ in range(n)]


def one_process_engine(policy: str) -> MixedPrecision:
    model = tiny_model()
    opt_cls = torch.optim.AdamW if ONE_PROCESS[policy] == "torch" else mixprec.optim.AdamW
    return MixedPrecision(model, opt_cls(model.parameters(), lr=1e-2, weight_decay=0.1), policy, device="cpu")


def dcp_engine(strategy: str | None) -> MixedPrecision:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return MixedPrecision(model, opt, "bf16-mixed", device="cpu", strategy=strategy, max_grad_norm=1.0,
                          scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))


def step(mp: MixedPrecision, batch: dict) -> float:
    batch = mp.cast_inputs(batch)
    with mp.autocast():
        loss = F.mse_loss(mp.model(batch["x"]).float(), batch["y"].float())
    mp.backward(loss)
    mp.step()
    return float(loss.detach())


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def snapshot(mp: MixedPrecision) -> dict:
    """The model state (stored dtypes) and the fp32 values the optimizer steps, by name, full tensors."""
    names = [n for n, _ in mp.module.named_parameters()]
    return {"model": {k: _full(v) for k, v in mp.module.state_dict().items()},
            "stepped": {n: _full(m) for n, m in zip(names, mp.master_parameters())}}


def continue_steps(mp: MixedPrecision, todo: list[dict]) -> dict:
    losses = [step(mp, b) for b in todo]
    return {"losses": losses, **snapshot(mp)}


def global_batches(start: int, n: int) -> list[dict]:
    """Global batches ``start .. start + n - 1``: each the concatenation of the 2 ranks' batches."""
    stream = batches((start + n) * WORLD, seed=2)
    return [{k: torch.cat([stream[(i * WORLD) + r][k] for r in range(WORLD)]) for k in stream[0]}
            for i in range(start, start + n)]


def rank_batches(rank: int, start: int, n: int) -> list[dict]:
    stream = batches((start + n) * WORLD, seed=2)
    return [stream[i * WORLD + rank] for i in range(start, start + n)]


# ---------------------------------------------------------------------------------------------- writing
def write_one_process(out: Path, policy: str) -> None:
    mp = one_process_engine(policy)
    todo = batches(SAVES[-1] + CONTINUE)
    for i, batch in enumerate(todo[:SAVES[-1]], start=1):
        step(mp, batch)
        if i in SAVES:
            mixprec.save_checkpoint(out / policy, mp, extra={"fixture": policy}, keep=KEEP[policy],
                                    data_position={"batches": i})
    fresh = one_process_engine(policy)
    mixprec.load_checkpoint(out / policy, fresh)
    torch.save(continue_steps(fresh, todo[SAVES[-1]:]), out / f"{policy}.expected.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, port: int, out: str, job: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    mpd.init_process_group_from_env("cpu", timeout=timedelta(seconds=60))
    try:
        mp = dcp_engine("fsdp2")
        root = Path(out) / "fsdp2"
        if job == "save":
            for batch in rank_batches(rank, 0, DCP_SAVE_AT):
                step(mp, batch)
            mpd.save_distributed_checkpoint(root, mp, extra={"fixture": "fsdp2"}, keep=1)
            result = snapshot(mp)
        else:
            mpd.load_distributed_checkpoint(root, mp)
            result = continue_steps(mp, rank_batches(rank, DCP_SAVE_AT, CONTINUE))
        torch.save(result, Path(out) / f".rank{rank}-{job}.pt")
    finally:
        mpd.leave_process_group(wait_for_all=True)


def run_ranks(out: Path, job: str, entry=_rank_entry) -> list[dict]:
    import torch.multiprocessing as torch_mp

    torch_mp.start_processes(entry, args=(_free_port(), str(out), job), nprocs=WORLD, start_method="spawn")
    results = []
    for r in range(WORLD):
        path = out / f".rank{r}-{job}.pt"
        results.append(torch.load(path))
        path.unlink()
    return results


def write_dcp(out: Path) -> None:
    at_save, _ = run_ranks(out, "save")
    two_ranks = run_ranks(out, "load")
    mp = dcp_engine(None)
    mpd.load_distributed_checkpoint(out / "fsdp2", mp)
    one = continue_steps(mp, global_batches(DCP_SAVE_AT, CONTINUE))
    torch.save({"at_save": at_save, "one_process": one, "two_ranks": two_ranks}, out / "fsdp2.expected.pt")


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    for name in ONE_PROCESS:
        write_one_process(target, name)
    write_dcp(target)
