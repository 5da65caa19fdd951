"""A DDP or FSDP built by someone else before the engine (issue 26): refused where the engine's casts would
make the ranks drift silently, allowed where the wrapper stays right."""

from __future__ import annotations

import pytest
import torch

import mixprec

# ---------------------------------------------------------------- a DDP built by someone else (issue 26)
@pytest.fixture
def gloo_world_of_one(monkeypatch):
    import socket
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_ddp_built_before_the_engine_is_refused_where_the_casts_would_break_it(gloo_world_of_one):
    """DDP builds its buckets for the params it is given: an engine that then casts them to bf16 (``-pure``,
    ``-sr``...) leaves the ranks reducing 16-bit gradients and drifting apart, silently (Lightning's ranks,
    issue 26). Refused before anything changes; fp32 params under a ``-mixed`` policy stay allowed (the
    wrapper reduces fp32 gradients), and ``strategy=`` never takes a wrapped model (it wraps itself)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    for policy in ("bf16-pure", "bf16-sr", "bf16-lean"):
        with pytest.raises(ValueError, match=r"model is a DistributedDataParallel built before MixedPrecision.*"
                                             r"strategy='ddp' or 'fsdp2'.*MixprecPrecision"):
            mixprec.MixedPrecision(ddp, mixprec.optim.AdamW(ddp.parameters(), lr=1e-3), policy)
        assert all(p.dtype == torch.float32 for p in model.parameters()), policy   # nothing cast
    with pytest.raises(ValueError, match=r"strategy='ddp' wraps the model itself"):
        mixprec.MixedPrecision(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), "fp32", strategy="ddp")
    mp = mixprec.MixedPrecision(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), "bf16-mixed")
    assert mp.policy.param_dtype == torch.float32 and mp.model is ddp
