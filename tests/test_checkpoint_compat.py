"""Checkpoints written by the main before issue 24 (fc21254) still load, and continue bit for bit.

The fixtures in ``tests/data/checkpoints`` were written by ``make_fixtures.py`` there with that main:
one-process roots under bf16-pure (torch AdamW) and bf16-lean (mixprec AdamW, 8-bit state), and a DCP
root from 2 FSDP2 gloo ranks, each with the values the old code reached continuing it. The current code
loads each (through ``mixprec.load_checkpoint``, which picks the format), continues on the same batches
and must reach the same values exactly: losses, the stored model state and the fp32 values the optimizer
steps.
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

DATA = Path(__file__).parent / "data" / "checkpoints"
_spec = importlib.util.spec_from_file_location("make_fixtures", DATA / "make_fixtures.py")
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)


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
    read differently. The reference is computed here, not read from ``.expected.pt``: that file holds what the
    old code reached on the CPU that wrote the fixtures, and bf16 matmuls round differently on another CPU (AMX
    or not), so comparing with it tested that machine (its losses are checked to the format's tolerance below)."""
    root = DATA / policy
    manifest = mixprec.checkpoint.read_manifest(root)   # verified: checksum, sizes, sha256, dtypes, shapes
    assert (manifest["format"], manifest["version"], manifest["step"]) == ("mixprec-checkpoint", 2, fx.SAVES[-1])
    mp = fx.one_process_engine(policy)
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


def test_dcp_checkpoint_of_two_old_ranks_loads_in_one_process_and_continues_equal():
    expected = torch.load(DATA / "fsdp2.expected.pt")
    manifest = mixprec.checkpoint.read_manifest(DATA / "fsdp2")
    assert (manifest["format"], manifest["strategy"], manifest["world_size"]) == ("mixprec-dcp", "fsdp2", 2)
    mp = fx.dcp_engine(None)
    assert mixprec.load_checkpoint(DATA / "fsdp2", mp) == {"fixture": "fsdp2"}
    assert mp.boundaries == fx.DCP_SAVE_AT
    for name, value in fx.snapshot(mp)["stepped"].items():
        assert torch.equal(value, expected["at_save"]["stepped"][name]), name
    _assert_same(fx.continue_steps(mp, fx.global_batches(fx.DCP_SAVE_AT, fx.CONTINUE)), expected["one_process"])


def _rank_load(rank: int, port: int, out: str, job: str) -> None:
    from mixprec.distributed import process as mpd

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(fx.WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    mpd.init_process_group_from_env("cpu", timeout=timedelta(seconds=60))
    try:
        mp = fx.dcp_engine("fsdp2")
        mixprec.load_checkpoint(Path(out) / "fsdp2", mp)
        result = fx.continue_steps(mp, fx.rank_batches(rank, fx.DCP_SAVE_AT, fx.CONTINUE))
        torch.save(result, Path(out) / f".rank{rank}-{job}.pt")
    finally:
        mpd.leave_process_group(wait_for_all=True)


@pytest.mark.timeout(120)
def test_dcp_checkpoint_of_two_old_ranks_loads_at_two_ranks_and_continues_equal(tmp_path):
    shutil.copytree(DATA / "fsdp2", tmp_path / "fsdp2")
    got = fx.run_ranks(tmp_path, "load", entry=_rank_load)
    for rank, want in enumerate(torch.load(DATA / "fsdp2.expected.pt")["two_ranks"]):
        _assert_same(got[rank], want)
