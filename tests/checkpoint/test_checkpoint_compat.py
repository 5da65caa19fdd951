"""Checkpoints written by the main before issue 24 (fc21254) still load, and continue bit for bit.

The fixtures in ``tests/data/checkpoints`` were written by ``make_fixtures.py`` there with that main:
one-process roots under bf16-pure (torch AdamW) and bf16-lean (mixprec AdamW, 8-bit state), and a DCP
root from 2 FSDP2 gloo ranks, each with the values the old code reached continuing it. The current code
loads each (through ``mixprec.load_checkpoint``, which picks the format), continues on the same batches
and must reach exactly what continuing the same state saved by today's code reaches on the machine under
test: losses, the stored model state and the fp32 values the optimizer steps. The reference is computed
here because bf16 matmuls round differently on another CPU (AMX or not): the ``.expected.pt`` values were
recorded on the CPU that wrote the fixtures, so they are compared only where they are exact on every CPU
(the state as loaded, before any step) or to the format's tolerance (the losses continuing it).

The bf16-lean run rounded stochastically with torch's global RNG (before the optimizers had ``sr_seed``), a stream
the current code does not have: its checkpoint is refused by name, and loads under
``mixprec.optim.adopt_sr_seed``, continuing on the seeded stream (bit for bit as today's save of that state does).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import mixprec

DATA = Path(__file__).resolve().parents[1] / "data" / "checkpoints"
_spec = importlib.util.spec_from_file_location("make_fixtures", DATA / "make_fixtures.py")
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)


# the old runs whose optimizer rounded stochastically from torch's global RNG (no sr_seed in its state dict)
OLD_GLOBAL_RNG_STREAM = {"bf16-lean"}


def _assert_same(got: dict, want: dict) -> None:
    assert got["losses"] == want["losses"]
    for part in ("model", "stepped"):
        assert got[part].keys() == want[part].keys(), part
        for name, tensor in want[part].items():
            assert got[part][name].dtype == tensor.dtype, (part, name)
            assert torch.equal(got[part][name], tensor), (part, name)


@pytest.mark.parametrize("policy", sorted(fx.ONE_PROCESS))
def test_one_process_checkpoint_of_the_old_main_loads_and_continues_bit_for_bit(policy, tmp_path):
    """The old root loads (verified manifest, the step, the extra), and continuing it gives, bit for bit, what
    continuing the same state saved by today's code gives on this machine: nothing of the old format is lost or
    read differently (bf16-lean: refused by name, then loaded under ``adopt_sr_seed``; its stochastic rounding
    continues on the seeded stream). The reference is computed here, not read from ``.expected.pt``: that file holds what the
    old code reached on the CPU that wrote the fixtures, and bf16 matmuls round differently on another CPU (AMX
    or not), so comparing with it tested that machine (its losses are checked to the format's tolerance below)."""
    root = DATA / policy
    manifest = mixprec.checkpoint.read_manifest(root)   # verified: checksum, sizes, sha256, dtypes, shapes
    assert (manifest["format"], manifest["version"], manifest["step"]) == ("mixprec-checkpoint", 2, fx.SAVES[-1])
    mp = fx.one_process_engine(policy)
    if policy in OLD_GLOBAL_RNG_STREAM:
        with pytest.raises(mixprec.checkpoint.CheckpointError) as refused:
            mixprec.load_checkpoint(root, mp)
        assert "AdamW.load_state_dict: saved param group 0 has no 'sr_seed'" in str(refused.value)
        assert "mixprec.optim.adopt_sr_seed(optimizer, sr_seed=<int>)" in str(refused.value)
        fresh = fx.one_process_engine(policy)   # the refused load changed nothing: weights, optimizer, counters
        for (name, got), want in zip(mp.module.state_dict().items(), fresh.module.state_dict().values()):
            assert torch.equal(got, want), name
        assert mp.boundaries == 0 and not mp.optimizer.state
        with mixprec.optim.adopt_sr_seed(mp.optimizer, sr_seed=0):
            assert mixprec.load_checkpoint(root, mp) == {"fixture": policy}
        assert [g["sr_seed"] for g in mp.optimizer.param_groups] == [0]
    else:
        assert mixprec.load_checkpoint(root, mp) == {"fixture": policy}
    assert mp.boundaries == fx.SAVES[-1]
    mixprec.save_checkpoint(tmp_path / "today", mp, extra={"fixture": policy})
    todo = fx.batches(fx.SAVES[-1] + fx.CONTINUE)[fx.SAVES[-1]:]
    got = fx.continue_steps(mp, todo)
    again = fx.one_process_engine(policy)   # loaded after mp continued: loading restores the RNG states it saved
    assert mixprec.load_checkpoint(tmp_path / "today", again) == {"fixture": policy}
    _assert_same(got, fx.continue_steps(again, todo))
    # the old code's losses on its own CPU: the same to bf16's rounding of this tiny model's outputs (|loss| ~ 1,
    # an mse over 32 outputs each within a few bf16 ulps: 2^-6 relative is 4 ulps of slack per output)
    want = torch.load(DATA / f"{policy}.expected.pt")["losses"]
    assert got["losses"] == pytest.approx(want, rel=2.0 ** -6)


def test_an_older_step_of_the_old_root_loads_too():
    mp = fx.one_process_engine("bf16-pure")
    mixprec.load_checkpoint(DATA / "bf16-pure" / f"step-{fx.SAVES[0]}", mp)
    assert mp.boundaries == fx.SAVES[0]


def _dcp_files(tmp_path: Path) -> dict:
    """The old DCP root's state as torch's own reader gives it (``dcp_to_torch_save``), not through mixprec."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "fsdp2-files.pt"
    dcp_to_torch_save(mixprec.checkpoint.resolve_checkpoint(DATA / "fsdp2") / "dcp", out)
    return torch.load(out)


def _loaded_state(mp: mixprec.MixedPrecision) -> dict:
    """What ``mp`` holds of what a DCP checkpoint stores, as full tensors by parameter name (collective under
    FSDP2: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optim = get_optimizer_state_dict(mp.module, mp.optimizer, options=StateDictOptions(full_state_dict=True))
    return {**fx.snapshot(mp),
            "optim_state": {name: {k: fx._full(v) for k, v in entry.items()} for name, entry in optim["state"].items()},
            "lrs": [(g["lr"], g["initial_lr"]) for g in optim["param_groups"]],
            "loss_scale": mp.loss_scale.state_dict()["state"], "scheduler": mp.scheduler.state_dict()}


def _assert_loaded_as_saved(loaded: dict, files: dict) -> None:
    """The state loaded from the old DCP root is exactly what its files hold: the model, the fp32 values the
    optimizer steps (the params themselves under bf16-mixed), the momentum buffers, the learning rates, the loss
    scale and the scheduler. Loading does no arithmetic, so this holds on every CPU."""
    assert loaded["model"].keys() == files["model"].keys() == loaded["stepped"].keys()
    for name, tensor in files["model"].items():
        for part in ("model", "stepped"):
            assert loaded[part][name].dtype == tensor.dtype and torch.equal(loaded[part][name], tensor), (part, name)
    assert loaded["optim_state"].keys() == files["optim"]["state"].keys()
    for name, entry in files["optim"]["state"].items():
        assert loaded["optim_state"][name].keys() == entry.keys(), name
        for key, tensor in entry.items():
            assert torch.equal(loaded["optim_state"][name][key], tensor), (name, key)
    assert loaded["lrs"] == [(g["lr"], g["initial_lr"]) for g in files["optim"]["param_groups"]] == [(0.05, 0.1)]
    assert loaded["loss_scale"].keys() == files["engine"]["loss_scale"].keys()
    for key, tensor in files["engine"]["loss_scale"].items():
        assert torch.equal(loaded["loss_scale"][key], tensor), key
    assert loaded["scheduler"] == files["engine"]["scheduler"]


# The old code's losses continuing the DCP root on its own CPU (fsdp2.expected.pt), checked to the format's
# tolerance only, as for the one-process roots: bf16-mixed runs the tiny model's matmuls in bf16, whose outputs
# round differently on another CPU (AMX or not); |loss| ~ 1, an mse of outputs each within a few bf16 ulps:
# 2^-6 relative is 4 ulps of slack per output.
OLD_CPU_LOSS_REL = 2.0 ** -6


def test_dcp_checkpoint_of_two_old_ranks_loads_in_one_process_and_continues_bit_for_bit(tmp_path):
    """The old 2-rank DCP root loads in one process exactly as its files hold it (and as the old ranks held it at
    save), and continuing it gives, bit for bit, what continuing the same state saved by today's code gives on
    this machine. The reference is computed here, not read from ``fsdp2.expected.pt``: that holds what the old
    code reached on the CPU that wrote the fixture (its losses are checked to the format's tolerance below)."""
    expected = torch.load(DATA / "fsdp2.expected.pt")
    manifest = mixprec.checkpoint.read_manifest(DATA / "fsdp2")
    assert (manifest["format"], manifest["strategy"], manifest["world_size"]) == ("mixprec-dcp", "fsdp2", 2)
    mp = fx.dcp_engine(None)
    assert mixprec.load_checkpoint(DATA / "fsdp2", mp) == {"fixture": "fsdp2"}
    assert mp.boundaries == fx.DCP_SAVE_AT
    _assert_loaded_as_saved(_loaded_state(mp), _dcp_files(tmp_path))
    for name, value in fx.snapshot(mp)["stepped"].items():   # what the old ranks held at save: read back, exact
        assert torch.equal(value, expected["at_save"]["stepped"][name]), name
    mixprec.save_checkpoint(tmp_path / "today", mp, extra={"fixture": "fsdp2"})
    todo = fx.global_batches(fx.DCP_SAVE_AT, fx.CONTINUE)
    got = fx.continue_steps(mp, todo)
    again = fx.dcp_engine(None)
    assert mixprec.load_checkpoint(tmp_path / "today", again) == {"fixture": "fsdp2"}
    assert again.boundaries == fx.DCP_SAVE_AT
    _assert_same(got, fx.continue_steps(again, todo))
    assert got["losses"] == pytest.approx(expected["one_process"]["losses"], rel=OLD_CPU_LOSS_REL)


def _rank_load(rank: int, port: int, out: str, job: str) -> None:
    """At one of 2 ranks: load the old root, note the loaded state, save it with today's code, continue; then
    load today's checkpoint into a fresh engine and continue it on the same batches (the reference)."""
    from mixprec.distributed import process as mpd

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(fx.WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    mpd.init_process_group_from_env("cpu", timeout=timedelta(seconds=60))
    try:
        mp = fx.dcp_engine("fsdp2")
        extra = mixprec.load_checkpoint(Path(out) / "fsdp2", mp)
        boundaries = [mp.boundaries]
        loaded = _loaded_state(mp)
        mixprec.save_checkpoint(Path(out) / "today", mp, extra={"fixture": "fsdp2"})
        todo = fx.rank_batches(rank, fx.DCP_SAVE_AT, fx.CONTINUE)
        continued = fx.continue_steps(mp, todo)
        again = fx.dcp_engine("fsdp2")
        mixprec.load_checkpoint(Path(out) / "today", again)
        boundaries.append(again.boundaries)
        result = {"extra": dict(extra), "boundaries": boundaries,
                  "loaded": loaded, "continued": continued, "reference": fx.continue_steps(again, todo)}
        torch.save(result, Path(out) / f".rank{rank}-{job}.pt")
    finally:
        mpd.leave_process_group(wait_for_all=True)


@pytest.mark.timeout(120)
def test_dcp_checkpoint_of_two_old_ranks_loads_at_two_ranks_and_continues_bit_for_bit(tmp_path):
    """At 2 ranks (FSDP2 shards): the old root loads exactly as its files hold it, and each rank continues bit
    for bit as it continues the same state saved by today's code (a DCP checkpoint too), on this machine; the old
    CPU's losses (``fsdp2.expected.pt``) to the format's tolerance."""
    shutil.copytree(DATA / "fsdp2", tmp_path / "fsdp2")
    files = _dcp_files(tmp_path)
    got = fx.run_ranks(tmp_path, "load", entry=_rank_load)
    assert mixprec.checkpoint.read_manifest(tmp_path / "today")["format"] == "mixprec-dcp"
    for rank, want in enumerate(torch.load(DATA / "fsdp2.expected.pt")["two_ranks"]):
        assert got[rank]["extra"] == {"fixture": "fsdp2"}
        assert got[rank]["boundaries"] == [fx.DCP_SAVE_AT, fx.DCP_SAVE_AT]
        _assert_loaded_as_saved(got[rank]["loaded"], files)
        _assert_same(got[rank]["continued"], got[rank]["reference"])
        assert got[rank]["continued"]["losses"] == pytest.approx(want["losses"], rel=OLD_CPU_LOSS_REL)
