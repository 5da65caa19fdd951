"""The engine's own measurements never disturb the user's (issue 37, part D), through Lightning's Trainer.

Every measurement the engine takes inside a user's training is on in one run: ``policy="auto"`` (the trial times
fp32 and bf16-mixed on the model at its first forward), ``recompute="auto"`` (each repeated block timed and
counted at its first call) and ``memory_budget=`` (the second step's peak live bytes, under the profiler on the
CPU). The reference is the same training with none of them: the policy ``auto`` chose, no recompute, no budget.
Each kind of state the user owns is compared between the two, exactly: the global random streams (torch, numpy,
python; the model draws from all three in its forward), BatchNorm running stats and ``num_batches_tracked``,
every param (bit for bit: nothing above changes a value), modules' train/eval modes, the user's hooks (still
registered, each called once per training forward and backward of its own, never by a measurement), the autocast
and grad state around the model's forward, ``torch.backends`` flags and a user's own ``torch.profiler`` session
(around the fit, over its first steps, scheduled and warming up through the measured step, Lightning's
``PyTorchProfiler``).
A tiny MLP of repeated blocks (Linear, BatchNorm1d, GELU, Dropout), SGD, 4 steps, CPU.

Last, Lightning's ModelParallelStrategy (part 2 of the same issue part): the engine's own FSDP2 under it on 2 gloo
ranks, bit for bit its own ``strategy="fsdp2"`` loop, and a model sharded in ``configure_model`` refused by name.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

L = pytest.importorskip("lightning")

import torch   # noqa: E402
import torch.nn.functional as F   # noqa: E402
from torch import nn   # noqa: E402
from torch.utils.data import DataLoader   # noqa: E402

from mixprec.autocast import op_plan   # noqa: E402
from mixprec.auto.pending import PendingAuto   # noqa: E402
from mixprec.integrations.lightning import MixprecPrecision   # noqa: E402
from mixprec.memory.live import peak_live_bytes   # noqa: E402
from mixprec.memory.recompute import measure_block   # noqa: E402
from mixprec.auto import trial as auto_policy   # noqa: E402

STEPS = 4
MEASURING = {"policy": "auto", "checkpoint": "auto", "memory_budget": "1GiB"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm, self.drop = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(F.gelu(self.norm(self.linear(h))))


class Net(L.LightningModule):
    """Repeated blocks (``recompute="auto"`` measures them), a BatchNorm the user keeps in eval mode, and a
    forward that draws from python's ``random`` and numpy's global generator (a LayerDrop written that way):
    a draw taken by a measurement would change every later step's values. Records the thread's autocast and
    grad state before and after each training forward, and counts its user hooks' calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.frozen = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.frozen.running_mean.uniform_(-1, 1)
        self.frozen.eval()
        self.calls = {"pre": 0, "forward": 0, "backward": 0}
        self.handles = [self.blocks[0].register_forward_pre_hook(self._count("pre")),
                        self.blocks[0].register_forward_hook(self._count("forward")),
                        self.blocks[0].register_full_backward_hook(self._count("backward"))]
        self.around: list[tuple[tuple, tuple]] = []

    def _count(self, kind: str):
        def hook(*_):
            self.calls[kind] += 1
        return hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.inp(x))
        if self.training:   # python's and numpy's streams, drawn as a LayerDrop or an augmentation would
            h = h * (1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand()))
        return self.head(self.frozen(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        before = _thread_state()
        out = self(x)
        self.around.append((before, _thread_state()))
        return F.cross_entropy(out.float(), y)

    def train(self, mode: bool = True):   # Lightning puts the model in train mode: the user's frozen norm stays eval
        super().train(mode)
        self.frozen.eval()
        return self

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _thread_state() -> tuple:
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled(),
            torch.is_grad_enabled(), torch.is_inference_mode_enabled())


def _flags() -> dict:
    """Process-wide settings a measurement could change."""
    return {"float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn.benchmark": torch.backends.cudnn.benchmark, "cudnn.deterministic": torch.backends.cudnn.deterministic,
            "cudnn.enabled": torch.backends.cudnn.enabled, "mkldnn.enabled": torch.backends.mkldnn.enabled,
            "deterministic": torch.are_deterministic_algorithms_enabled(), "threads": torch.get_num_threads(),
            "default_dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
            "autocast_cpu": torch.is_autocast_enabled("cpu"), "autocast_cache": torch.is_autocast_cache_enabled()}


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _fit(options: dict, *, callbacks=(), steps: int = STEPS, trainer_kw=None,
         model: Net | None = None) -> tuple[MixprecPrecision, Net]:
    """One seeded Lightning fit of a fresh ``Net`` (or ``model``) under ``MixprecPrecision(**options)``."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model, plugin = model or Net(), MixprecPrecision(**options)
    trainer = L.Trainer(**{"max_steps": steps, "accelerator": "cpu", "devices": 1, "logger": False,
                           "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                           "num_sanity_val_steps": 0, "plugins": [plugin], "callbacks": list(callbacks),
                           **(trainer_kw or {})})
    trainer.fit(model, DataLoader(_batches(steps), batch_size=None, shuffle=False))
    return plugin, model


def _streams() -> tuple:
    """torch's CPU generator state, numpy's global generator state (key, position, cached gaussian), python's."""
    _, key, pos, has_gauss, gauss = np.random.get_state()
    return torch.get_rng_state(), (key.copy(), pos, has_gauss, gauss), random.getstate()


def _same_streams(a: tuple, b: tuple) -> bool:
    return (torch.equal(a[0], b[0]) and np.array_equal(a[1][0], b[1][0]) and a[1][1:] == b[1][1:]
            and a[2] == b[2])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(measured: plugin, model, streams and flags after; reference: the same) — the fits once for every test."""
    before = {"MIXPREC_CACHE_DIR": os.environ.get("MIXPREC_CACHE_DIR"), "precision": torch.get_float32_matmul_precision(),
              "benchmark": torch.backends.cudnn.benchmark}
    os.environ["MIXPREC_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))   # auto and the plan measure afresh
    auto_policy._MEMORY.clear()
    op_plan.forget()
    torch.set_float32_matmul_precision("high")   # the user's own settings, not the defaults
    torch.backends.cudnn.benchmark = True
    try:
        flags = _flags()
        measured = _fit(MEASURING)
        after_measured = (_streams(), _flags())
        reference = _fit({"policy": str(measured[0].engine.policy)})
        after_reference = (_streams(), _flags())
    finally:
        torch.set_float32_matmul_precision(before["precision"])
        torch.backends.cudnn.benchmark = before["benchmark"]
        if before["MIXPREC_CACHE_DIR"] is None:
            os.environ.pop("MIXPREC_CACHE_DIR")
        else:
            os.environ["MIXPREC_CACHE_DIR"] = before["MIXPREC_CACHE_DIR"]
        auto_policy._MEMORY.clear()
        op_plan.forget()
    return {"measured": measured, "reference": reference, "flags": flags, "after": (after_measured, after_reference)}


def test_every_measurement_ran(runs):
    engine = runs["measured"][0].engine
    kinds = {e.kind: e.cause for e in engine.events}
    assert kinds.get("auto") == "auto: timed on this model at its first forward"
    assert kinds.get("recompute") == "auto" and kinds.get("memory-budget") == "measured"
    assert engine.state_dict()["memory_budget"]["step"] == 2


def test_random_streams_are_the_runs_own(runs):
    """torch's, numpy's and python's global streams end where the reference's end (the model draws from all
    three in every training forward: a measurement's draws would shift them), and every param is bit for bit the
    reference's (a shifted draw changes the values)."""
    (measured, _), (reference, _) = runs["after"]
    assert torch.equal(measured[0], reference[0]), "torch's stream"
    assert np.array_equal(measured[1][0], reference[1][0]) and measured[1][1:] == reference[1][1:], "numpy's stream"
    assert measured[2] == reference[2], "python's stream"
    (_, a), (_, b) = runs["measured"], runs["reference"]
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_batchnorm_stats_and_modes_are_the_runs_own(runs):
    (_, a), (_, b) = runs["measured"], runs["reference"]
    for (name, x), y in zip(a.named_buffers(), b.buffers()):
        assert torch.equal(x, y), name   # running stats and num_batches_tracked: one update per training forward
    assert int(a.blocks[0].norm.num_batches_tracked) == STEPS
    assert not a.frozen.training and torch.equal(a.frozen.running_mean, Net().frozen.running_mean)
    assert [m.training for m in a.modules()] == [m.training for m in b.modules()]


def test_user_hooks_stay_registered_and_run_only_in_the_passes_said(runs):
    """The user's hooks stay registered (and the engine's measuring hooks are gone: the pending-auto pre-hook).
    They run once per training forward and backward, plus in each pass of auto's trial, which times the model as
    it trains, hooks included (documented: docs/policies.md); recompute="auto" times the block's own forward,
    not a call of the block, so hooks on the block do not run there."""
    (_, a), (_, b) = runs["measured"], runs["reference"]
    block = a.blocks[0]
    for handle, hooks in zip(a.handles, (block._forward_pre_hooks, block._forward_hooks, block._backward_hooks)):
        assert handle.id in hooks
    assert (len(block._forward_pre_hooks), len(block._forward_hooks)) == (1, 1)
    pending = [h for h in a._forward_pre_hooks.values() if isinstance(getattr(h, "__self__", None), PendingAuto)]
    assert pending == []   # the trial's pre-hook removed once it decided
    trial = (auto_policy.WARMUP + auto_policy.BLOCKS * auto_policy.STEPS) * 2   # passes of fp32 and bf16-mixed
    assert b.calls == {"pre": STEPS, "forward": STEPS, "backward": STEPS}
    assert a.calls == {kind: n + trial for kind, n in b.calls.items()}


def test_autocast_and_grad_state_around_the_forward_are_the_steps_own(runs):
    """After each training forward the thread's autocast (on, dtype, cast cache on) and grad state are the
    reference's; from the second step on also before it. (The first forward of ``auto`` starts in the fp32 build
    and turns the chosen autocast on for the rest of the step: docs/policies.md.)"""
    (_, a), (_, b) = runs["measured"], runs["reference"]
    assert [after for _, after in a.around] == [after for _, after in b.around]
    assert a.around[1:] == b.around[1:] and all(before == after for before, after in b.around)


def test_backends_flags_are_untouched(runs):
    (_, measured_flags), _ = runs["after"]
    assert measured_flags == runs["flags"]
    assert measured_flags["float32_matmul_precision"] == "high" and measured_flags["cudnn.benchmark"]


# ---------------------------------------------------------------------- a user's own profiler session
def _mm_count(prof) -> int:
    return sum(1 for e in prof.events() if e.name in ("aten::addmm", "aten::mm"))


class ProfileSteps(L.Callback):
    """The user's ``torch.profiler`` session from the start of training step ``first`` to the end of ``last``."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.first:
            self.prof.start()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == self.last:
            self.prof.stop()


def test_a_users_profiler_around_training_keeps_its_whole_trace_and_the_budget_waits():
    """memory_budget's CPU measurement runs the profiler itself: inside a user's session it would end that
    session's trace. With a session around the whole fit, the user's trace holds every step's matmuls (as the
    same fit without a budget records) and the budget stays pending, said in an event."""
    user = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with user:
        plugin, _ = _fit({"policy": "fp32", "memory_budget": "1GiB"})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as plain:
        _fit({"policy": "fp32"})
    assert _mm_count(user) == _mm_count(plain) > 0
    engine = plugin.engine
    deferred = [e for e in engine.events if e.kind == "memory-budget"]
    assert [e.cause for e in deferred] == ["deferred"] and deferred[0].step == 1
    assert "profiler" in deferred[0].detail and engine.state_dict()["memory_budget"] is None
    assert "pending" in engine.decision and "profiler session was recording" in engine.decision


def test_the_budget_is_measured_at_the_first_step_after_the_users_profiler_ends():
    """The user profiles steps 0-1; the measured step moves from step index 1 to 2 (boundary 3), and measures what
    the step measures without the user's session (the steps from the second on allocate alike); the user's
    trace holds both steps' matmuls, as without a budget."""
    mine = ProfileSteps(0, 1)
    plugin, _ = _fit({"policy": "fp32", "memory_budget": "1GiB"}, callbacks=[mine])
    plain = ProfileSteps(0, 1)
    _fit({"policy": "fp32"}, callbacks=[plain])
    undisturbed, _ = _fit({"policy": "fp32", "memory_budget": "1GiB"})
    assert _mm_count(mine.prof) == _mm_count(plain.prof) > 0
    decided, reference = plugin.engine.state_dict()["memory_budget"], undisturbed.engine.state_dict()["memory_budget"]
    assert (decided["step"], reference["step"]) == (3, 2)
    assert decided["peak_bytes"] == reference["peak_bytes"] > 0
    causes = [e.cause for e in plugin.engine.events if e.kind == "memory-budget"]
    assert causes == ["deferred", "measured"]


class ScheduledProfile(L.Callback):
    """The user's scheduled ``torch.profiler`` session stepped after each batch (wait 1, warm up 1, record 2): the
    measured step (the second) runs while it warms up, prepared but not recording."""

    def __init__(self) -> None:
        self.recorded: list[int] = []
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                           schedule=torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1),
                                           on_trace_ready=lambda p: self.recorded.append(_mm_count(p)))

    def on_train_start(self, trainer, module):
        self.prof.start()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.prof.step()

    def on_train_end(self, trainer, module):
        self.prof.stop()


def test_a_users_scheduled_profiler_warming_up_through_the_measured_step_records_as_without_it():
    """A session of the meter's own opened while the user's scheduled session warmed up made the user's session
    crash when it began recording (a segfault, torch 2.13: the meter's kineto session took what the warm-up had
    prepared). The meter's legacy mode leaves it alone: the user's two recorded steps hold their matmuls as without
    a budget, and the budget measures its step as without the user's session."""
    mine, plain = ScheduledProfile(), ScheduledProfile()
    # a budgeted fit first: what a process allocates once (1 KiB once, in a full-suite run) lands outside the compared
    _fit({"policy": "fp32", "memory_budget": "1GiB"}, steps=5)
    plugin, _ = _fit({"policy": "fp32", "memory_budget": "1GiB"}, callbacks=[mine], steps=5)
    _fit({"policy": "fp32"}, callbacks=[plain], steps=5)
    undisturbed, _ = _fit({"policy": "fp32", "memory_budget": "1GiB"}, steps=5)
    assert mine.recorded == plain.recorded and mine.recorded[0] > 0
    assert plugin.engine.state_dict()["memory_budget"] == undisturbed.engine.state_dict()["memory_budget"]
    assert plugin.engine.state_dict()["memory_budget"]["step"] == 2


def test_peak_live_bytes_inside_a_users_session_is_refused_and_leaves_it_recording():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as user:
        torch.ones(4) @ torch.ones(4)
        with pytest.raises(RuntimeError, match="a profiler session was recording.*measure outside the session"):
            peak_live_bytes(lambda: torch.ones(8), "cpu")
        torch.ones(4) @ torch.ones(4)
    assert sum(1 for e in user.events() if e.name == "aten::dot") == 2


def test_lightnings_pytorch_profiler_keeps_its_trace_and_the_budget_waits(tmp_path):
    """Lightning's PyTorchProfiler steps its schedule at the end of each training_step, inside the engine's step:
    its session opens there (torch allows one per thread: a session of the engine's own made the fit raise
    "Profiler is already enabled on this thread"). The plugin holds the measurement for such a Trainer: the fit
    runs, the profiler records the matmuls it records without a budget, and the budget says it waits."""
    from lightning.pytorch.profilers import PyTorchProfiler

    counts, engines = [], []
    for budget in ({}, {"memory_budget": "1GiB"}):
        profiler = PyTorchProfiler(dirpath=tmp_path, filename=f"trace{len(counts)}")
        plugin, _ = _fit({"policy": "fp32", **budget}, steps=8, trainer_kw={"profiler": profiler})
        counts.append(sum(1 for e in profiler.function_events if e.name in ("aten::addmm", "aten::mm")))
        engines.append(plugin.engine)
    assert counts[0] == counts[1] > 0
    deferred = [e for e in engines[1].events if e.kind == "memory-budget"]
    assert [(e.cause, e.step) for e in deferred] == [("deferred", 1)] and "PyTorchProfiler" in deferred[0].detail
    assert engines[1].state_dict()["memory_budget"] is None


def test_the_trial_and_the_block_timings_are_named_in_a_users_trace(tmp_path, monkeypatch):
    """The measurements that run the user's model show in the user's trace inside one named range each: one auto
    trial, one timing per repeated block."""
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    auto_policy._MEMORY.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as user:
        _fit({"policy": "auto", "checkpoint": "auto"}, steps=1)
    auto_policy._MEMORY.clear()
    names = [e.name for e in user.events()]
    assert names.count("mixprec: auto trial (fp32 vs bf16-mixed)") == 1
    assert names.count("mixprec: checkpoint block timing") == 3


# ---------------------------------------------------------------------- recompute="auto"'s block timings
def test_block_timings_leave_pythons_and_numpys_streams():
    """measure_block runs the block's forward a dozen times; a block drawing from python's ``random`` and numpy's
    global generator (a LayerDrop written that way) leaves both streams where they were."""
    class Drawing(Block):
        def forward(self, h):
            return super().forward(h) * (1.0 + random.random() + float(np.random.rand()))

    block = Drawing()
    x = torch.randn(4, 16, requires_grad=True)
    before = _streams()
    measure_block(block.forward, list(block.parameters()), (x,), {}, torch.device("cpu"), repeats=1)
    assert _same_streams(before, _streams())



# ---------------------------------------------------------------------- Lightning's ModelParallelStrategy (FSDP2)
def _sgd_for(policy: str) -> type[torch.optim.Optimizer]:
    """torch's SGD, or mixprec's where the policy rounds its updates (-kahan, -sr, -lean: torch's cannot)."""
    import mixprec

    return mixprec.optim.SGD if policy.split("-")[-1] in ("kahan", "sr", "lean") else torch.optim.SGD


class Flat(L.LightningModule):
    """Blocks in a ModuleList (the engine's FSDP2 units), no BatchNorm, no dropout; SGD (``sgd``: its class)."""

    def __init__(self, sgd: type[torch.optim.Optimizer] = torch.optim.SGD) -> None:
        super().__init__()
        self.sgd = sgd
        torch.manual_seed(0)
        self.inp, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).float(), y)

    def configure_model(self):   # empty: the engine shards (strategy="fsdp2")
        pass

    def configure_optimizers(self):
        return self.sgd(self.parameters(), lr=0.1)


class Sharded(Flat):
    def configure_model(self):   # where a ModelParallelStrategy user usually shards the model
        from torch.distributed.fsdp import fully_shard

        for block in self.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])


def _samples(n: int):
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _lightning_fsdp2_rank(rank: int, out, steps: int, policy: str, accumulate: int) -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    model = Flat(_sgd_for(policy))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                        accumulate_grad_batches=accumulate, plugins=[MixprecPrecision(policy)])
    trainer.fit(model, DataLoader(_samples(4 * 2 * accumulate * steps), batch_size=4))
    return {"params": _full(model), "steps": trainer.global_step, "strategy": trainer.precision_plugin.engine.strategy}


def _engine_fsdp2_rank(rank: int, out, steps: int, policy: str, accumulate: int) -> dict:
    from mixprec import MixedPrecision

    model = Flat()
    mp = MixedPrecision(model, _sgd_for(policy)(model.parameters(), lr=0.1), policy, device="cpu",
                        strategy="fsdp2", accumulation_steps=accumulate)
    data = _samples(4 * 2 * accumulate * steps)
    # the sampler Lightning puts under a training DataLoader: shuffled, seeded by $PL_GLOBAL_SEED (0 unset), epoch 0
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=seed)
    for i, batch in enumerate(DataLoader(data, batch_size=4, sampler=sampler)):
        batch = mp.cast_inputs(batch)
        with mp.autocast():
            loss = model.training_step(batch, i)
        mp.backward(loss)
        mp.step()
    return {"params": _full(model)}


@pytest.mark.parametrize("policy, accumulate", [("bf16-mixed", 2), ("bf16-pure", 1), ("fp16-mixed", 1),
                                               ("bf16-kahan", 1), ("bf16-sr", 1), ("bf16-lean", 1)])
def test_model_parallel_strategy_runs_the_engines_fsdp2_bit_for_bit(policy, accumulate):
    """Lightning's ModelParallelStrategy (2 gloo ranks, data parallel 2) with the plugin and an empty
    configure_model: the plugin builds the engine with strategy="fsdp2", which shards the module; 3 steps (of
    ``accumulate_grad_batches`` micro-batches, against the engine's ``accumulation_steps``) equal the
    engine's own strategy="fsdp2" loop on the same global batches (the DistributedSampler Lightning puts under the
    training DataLoader) bit for bit, every full param on every rank."""
    import tempfile
    from pathlib import Path

    from ranks import run_ranks

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        trained = run_ranks(_lightning_fsdp2_rank, Path(a), 3, policy, accumulate)
        reference = run_ranks(_engine_fsdp2_rank, Path(b), 3, policy, accumulate)
    assert [r["steps"] for r in trained] == [3, 3] and trained[0]["strategy"] == "fsdp2"
    for rank in range(2):
        for name, value in reference[rank]["params"].items():
            assert torch.equal(trained[rank]["params"][name], value), (rank, name)
    assert not torch.equal(reference[0]["params"]["head.weight"], Flat().head.weight.detach())   # it trained


@pytest.mark.parametrize("model, policy, words", [
    (Sharded, "bf16-mixed", r"configure_model sharded the model already .* Leave configure_model empty.*"
                            r"strategy='ddp'"),
])
def test_model_parallel_strategy_refusals_name_the_fix(model, policy, words):
    """ModelParallelStrategy calls configure_model before the plugin's convert_module: shards laid out there are
    not the engine's (they failed inside the step on "mixed torch.Tensor and DTensor"): refused naming the fix."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    environ = dict(os.environ)
    try:
        with pytest.raises(ValueError, match=words):
            _fit({"policy": policy}, steps=1, model=model(), trainer_kw={"strategy": ModelParallelStrategy()})
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


def _model_parallel_accumulating_rank(rank: int, out, policy: str) -> str | None:
    """accumulate_grad_batches=2 under ModelParallelStrategy: the ValueError's text on this rank (None: it trained)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                        accumulate_grad_batches=2, plugins=[MixprecPrecision(policy)])
    try:
        trainer.fit(Flat(_sgd_for(policy)), DataLoader(_samples(16), batch_size=4))
    except ValueError as err:
        return str(err)
    return None


def test_model_parallel_strategy_refuses_accumulation_into_16_bit_gradient_shards():
    """bf16-sr under ModelParallelStrategy with accumulate_grad_batches=2 ran, and its weights differed from the
    engine's own strategy="fsdp2" with accumulation_steps=2 by one bf16 ulp in a few elements: each micro-batch
    was reduce-scattered and summed into the bf16 gradient shard (the engine sums the micro-batches in fp32 and
    rounds once). Refused on every rank, naming the routes that work."""
    import tempfile
    from pathlib import Path

    from ranks import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        errors = run_ranks(_model_parallel_accumulating_rank, Path(tmp), "bf16-sr")
    for err in errors:
        assert err is not None and "accumulate_grad_batches=2 on 2 processes under ModelParallelStrategy with bf16-sr" \
            in err and "accumulate_grad_batches=1" in err and "accumulation_steps=2" in err, err


def _model_parallel_epochs(epochs: int, policy: str, **strategy_kw) -> L.Trainer:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return L.Trainer(max_steps=-1, max_epochs=epochs, accelerator="cpu", devices=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, plugins=[MixprecPrecision(policy)],
                     strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, **strategy_kw))


def _adamw_for(policy: str) -> type[torch.optim.Optimizer]:
    import mixprec

    return mixprec.optim.AdamW if policy.split("-")[-1] in ("kahan", "sr", "lean") else torch.optim.AdamW


def _model_parallel_resume_rank(rank: int, out, policy: str) -> dict:
    """2 epochs of 2 steps whole, and 1 epoch + Lightning's distributed checkpoint + fit(ckpt_path=...) to 2."""
    data = lambda: DataLoader(_samples(16), batch_size=4)   # noqa: E731  (2 ranks x 4 x 2 steps: one epoch)
    whole = Flat(_adamw_for(policy))
    _model_parallel_epochs(2, policy).fit(whole, data())
    first = Flat(_adamw_for(policy))
    trainer = _model_parallel_epochs(1, policy)
    trainer.fit(first, data())
    trainer.save_checkpoint(out / "epoch0.ckpt")   # a directory of DCP shards (the strategy's default)
    resumed = Flat(_adamw_for(policy))
    trainer = _model_parallel_epochs(2, policy)
    trainer.fit(resumed, data(), ckpt_path=out / "epoch0.ckpt")
    state = trainer.precision_plugin.engine.optimizer.state
    return {"whole": _full(whole), "resumed": _full(resumed), "steps": trainer.global_step,
            "state_keys": sorted({k for s in state.values() for k in s})}


def test_model_parallel_strategy_resumes_bit_for_bit():
    """fit(ckpt_path=...) under ModelParallelStrategy was refused (before: it failed on words about weights_only).
    bf16-kahan with mixprec's AdamW (moments and Kahan compensation, created under the policy's precision, which
    Lightning's own load misses: it fills the entries torch's defaults create): 1 epoch, Lightning's distributed
    checkpoint, and a resumed epoch give every rank's full params of the 2-epoch run bit for bit."""
    import tempfile
    from pathlib import Path

    from ranks import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        runs = run_ranks(_model_parallel_resume_rank, Path(tmp), "bf16-kahan")
    for rank, run in enumerate(runs):
        assert run["steps"] == 4 and "kahan_comp" in run["state_keys"] and "exp_avg" in run["state_keys"], run
        for name, value in run["whole"].items():
            assert torch.equal(run["resumed"][name], value), (rank, name)
    assert not torch.equal(runs[0]["whole"]["head.weight"], Flat().head.weight.detach().bfloat16())   # it trained


def _model_parallel_single_file_rank(rank: int, out, policy: str) -> str | None:
    first = _model_parallel_epochs(1, policy, save_distributed_checkpoint=False)
    first.fit(Flat(torch.optim.AdamW), DataLoader(_samples(16), batch_size=4))
    first.save_checkpoint(out / "mp.ckpt")
    try:
        _model_parallel_epochs(2, policy).fit(Flat(torch.optim.AdamW), DataLoader(_samples(16), batch_size=4),
                                              ckpt_path=out / "mp.ckpt")
    except ValueError as err:
        return str(err)
    return None


def test_model_parallel_strategy_single_file_resume_is_refused_by_name():
    """A single-file checkpoint (save_distributed_checkpoint=False) is refused on every rank with the routes."""
    import tempfile
    from pathlib import Path

    from ranks import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        errors = run_ranks(_model_parallel_single_file_rank, Path(tmp), "bf16-mixed")
    for err in errors:
        assert err is not None and "a single-file checkpoint (save_distributed_checkpoint=False) is not supported" \
            in err and "save_distributed_checkpoint=True" in err and "load_checkpoint" in err, err


def _model_parallel_adopt_rank(rank: int, out, policy: str) -> dict:
    """1 epoch under precision="32-true" (no plugin) and its checkpoint; 1 more epoch adopted under ``policy``;
    the same 2 epochs under the plugin from the start (its first epoch then equals 32-true's under bf16-mixed only
    in the weights' fp32 values: compared on the adopted run's own terms below)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    first = L.Trainer(max_steps=-1, max_epochs=1, accelerator="cpu", devices=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                      use_distributed_sampler=False)
    fp32 = Flat(_adamw_for(policy))   # the same optimizer class in both runs: Lightning loads its param groups as saved
    # precision="32-true", no plugin: nothing shards or syncs the replicas, so both ranks train on the same batches
    first.fit(fp32, DataLoader(_samples(16), batch_size=4))
    first.save_checkpoint(out / "fp32.ckpt")
    saved = {n: p.detach().clone() for n, p in fp32.named_parameters()}   # plain params: nothing sharded them
    start = {}

    class Peek(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            start.update(start or _full(module))

    adopted, trainer = Flat(_adamw_for(policy)), _model_parallel_epochs(2, policy)
    trainer.callbacks.append(Peek())
    try:
        trainer.fit(adopted, DataLoader(_samples(16), batch_size=4), ckpt_path=out / "fp32.ckpt")
    except ValueError as err:
        return {"error": str(err)}
    engine = trainer.precision_plugin.engine
    return {"error": None, "events": [e.kind for e in engine.events], "applied": engine.applied_steps,
            "steps": trainer.global_step, "moved": any(not torch.equal(saved[n], v) for n, v in _full(adopted).items()),
            "loaded": all(torch.equal(saved[n], v) for n, v in start.items())}


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-sr"])
def test_model_parallel_strategy_adopts_a_32_true_run_into_fp32_shards_and_refuses_16_bit_ones(policy):
    """Adopting a 32-true run under ModelParallelStrategy was refused; where the engine's shards are fp32 (bf16-mixed)
    Lightning loads them exactly and the engine takes the run's steps, with an adopt-checkpoint event; under 16-bit
    storage (bf16-sr) it is refused by name (a load would round without the policy's conversion)."""
    import tempfile
    from pathlib import Path

    from ranks import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        runs = run_ranks(_model_parallel_adopt_rank, Path(tmp), policy)
    for run in runs:
        if policy == "bf16-sr":
            assert "stores the shards in 16 bits" in run["error"] and "strategy='ddp'" in run["error"], run
            continue
        assert run["error"] is None and "adopt-checkpoint" in run["events"], run
        assert run["steps"] == 6 and run["applied"] == 6 and run["moved"], run   # 4 adopted + 2 trained steps
        assert run["loaded"], run   # the 32-true run's fp32 weights, exactly


class _SaveInsideWindow(L.Callback):
    """``trainer.save_checkpoint`` (collective) after the first micro-batch of the second window."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 2:
            trainer.save_checkpoint(self.path)


def _model_parallel_window_rank(rank: int, out, policy: str) -> dict:
    """3 steps of 2 micro-batches per rank: whole, saving inside the second window, resumed from that checkpoint."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from test_integration_checkpoints_any_moment import Resumable

    g = torch.Generator().manual_seed(5 + rank)
    batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(6)]
    path, runs = out / "window.ckpt", {}
    for name, callbacks, ckpt in (("whole", [], None), ("saving", [_SaveInsideWindow(path)], None),
                                  ("resumed", [], path)):
        model = Flat(torch.optim.AdamW)
        trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                            accumulate_grad_batches=2, plugins=[MixprecPrecision(policy)], callbacks=callbacks,
                            use_distributed_sampler=False)
        trainer.fit(model, Resumable(batches), ckpt_path=ckpt)
        runs[name] = {"params": _full(model), "steps": trainer.global_step}
    return runs


def test_model_parallel_strategy_checkpoint_inside_a_window_resumes_bit_for_bit():
    """A checkpoint after the first micro-batch of a window under ModelParallelStrategy failed with the hand loop's
    words ("call mp.step(end_group=True)"). The plugin runs Lightning's window as one micro-batch of the engine, so
    FSDP2 reduce-scatters each micro-batch into the params' sharded .grad: the checkpoint holds every rank's shards
    of the window, each rank takes its own back, and the resumed run equals the whole one bit for bit."""
    import tempfile
    from pathlib import Path

    from ranks import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(_model_parallel_window_rank, Path(tmp), "bf16-mixed")
    for rank, runs in enumerate(ranks):
        assert runs["whole"]["steps"] == runs["saving"]["steps"] == runs["resumed"]["steps"] == 3
        for name, value in runs["whole"]["params"].items():
            assert torch.equal(runs["saving"]["params"][name], value), (rank, name)   # saving changes nothing
            assert torch.equal(runs["resumed"]["params"][name], value), (rank, name)


def _model_parallel_policy_change_rank(rank: int, out, saved: str, resumed: str) -> str | None:
    import mixprec

    first = _model_parallel_epochs(1, saved)   # one optimizer class in both runs: Lightning's own load needs it
    first.fit(Flat(mixprec.optim.AdamW), DataLoader(_samples(16), batch_size=4))
    first.save_checkpoint(out / "saved.ckpt")
    try:
        _model_parallel_epochs(2, resumed).fit(Flat(mixprec.optim.AdamW), DataLoader(_samples(16), batch_size=4),
                                               ckpt_path=out / "saved.ckpt")
    except ValueError as err:
        return str(err)
    return None


def test_model_parallel_strategy_refuses_a_policy_change_on_resume_by_name():
    """A bf16-mixed checkpoint resumed under MixprecPrecision("bf16-kahan") killed both ranks inside torch's DCP
    load (a CheckpointException, a BaseException: "Missing key ... kahan_comp"); refused before the load, naming the
    saved policy to resume with."""
    import tempfile
    from pathlib import Path

    from ranks import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        errors = run_ranks(_model_parallel_policy_change_rank, Path(tmp), "bf16-mixed", "bf16-kahan")
    for err in errors:
        assert err is not None and "saved under MixprecPrecision('bf16-mixed'), this plugin runs bf16-kahan" in err \
            and "resume with MixprecPrecision('bf16-mixed')" in err, err
