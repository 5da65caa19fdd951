"""mixprec inside Lightning's Trainer (issue 26): :class:`mixprec.integrations.lightning.MixprecPrecision`.

The reference is a hand-written :class:`mixprec.MixedPrecision` loop on the same model, batches and optimizer:
every comparison is bit for bit (``torch.equal``), on the fp32 values the optimizer steps
(``trainable_state_dict()``: the masters under ``-pure``, param plus Kahan compensation under ``-kahan``) and
on the stored params. Where the engine's own loop cannot express Lightning's behaviour (an epoch's short last
accumulation window), the reference is Lightning's own fp32 training (``precision="32-true"``) against the
plugin under the ``fp32`` policy. A tiny GPT (1 layer, 16 wide, vocab 32, 8 tokens; fp16 matmuls are slow on
CPUs), AdamW from :mod:`mixprec.optim`, CPU.
"""

from __future__ import annotations

import pytest

L = pytest.importorskip("lightning")

import torch   # noqa: E402
import torch.nn.functional as F   # noqa: E402
from torch.utils.data import DataLoader   # noqa: E402

import mixprec.optim   # noqa: E402
from mixprec import MixedPrecision   # noqa: E402
from mixprec.engine.loss_scale import DynamicLossScale   # noqa: E402
from mixprec.integrations.lightning import MixprecPrecision   # noqa: E402
from mixprec.workloads.gpt import GPT, GPTConfig   # noqa: E402

VOCAB = 32
CONFIG = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, batch_size=2)
PRESETS = ["bf16-mixed", "bf16-pure", "fp16-mixed", "bf16-kahan", "bf16-lean,kernels=native"]


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (2, CONFIG.block_size + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def lr_at(step: int) -> float:
    return 1.0 / (1.0 + step)


class TinyGPT(L.LightningModule):
    """A tiny GPT-2 from a config. ``scheduler``: a LambdaLR with interval 'step'; ``spikes``: batch indices
    whose loss is multiplied by 1e5 (an fp16 overflow of the scaled gradients, the loss itself finite)."""

    def __init__(self, scheduler: bool = False, spikes: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(CONFIG, VOCAB)
        self.scheduler, self.spikes = scheduler, spikes
        self.seen_norms: list[torch.Tensor] = []
        self.seen_dtypes: set[torch.dtype] = set()
        self.seen_checked = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)

    def loss(self, batch, index: int = -1) -> torch.Tensor:
        idx, tgt = batch
        loss = F.cross_entropy(self(idx).float().flatten(0, 1), tgt.flatten())
        return loss * 1e5 if index in self.spikes else loss

    def training_step(self, batch, batch_idx):
        return self.loss(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        opt = mixprec.optim.AdamW(self.parameters(), lr=1e-2)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:   # Lightning's own fp32 step of a window whose training_steps all returned None
            return
        self.seen_dtypes |= {g.dtype for g in grads}
        self.seen_norms.append(torch.nn.utils.get_total_norm([g.float() for g in grads], 2.0))
        self.seen_sizes = (max(g.numel() for g in grads), len(grads))
        check = getattr(self.trainer.precision_plugin, "step_check", None)   # the engine's open check
        self.seen_checked &= check is not None and len(grads) == len(check.grads) and \
            all(a is b for a, b in zip(grads, check.grads))


def hand_loop(policy: str, data, *, model: TinyGPT | None = None, accumulate: int = 1, clip: float | None = None,
              **options) -> tuple[MixedPrecision, list]:
    """The reference: ``MixedPrecision`` by hand on ``data``, ``accumulate`` micro-batches per step."""
    model = model or TinyGPT()
    configured = model.configure_optimizers()
    opt, sched = (configured["optimizer"], configured["lr_scheduler"]["scheduler"]) if isinstance(configured, dict) \
        else (configured, None)
    mp = MixedPrecision(model, opt, policy, device="cpu", scheduler=sched, accumulation_steps=accumulate,
                        max_grad_norm=clip, **options)
    results = []
    for i, batch in enumerate(loader(data)):   # a DataLoader, as Lightning's: its iterator draws a seed from the
        batch = mp.cast_inputs(batch)           # global RNG, which stochastic rounding draws from too
        with mp.autocast():
            loss = model.training_step(batch, i)
        mp.backward(loss)
        result = mp.step()
        if result is not None:
            results.append(result)
    return mp, results


def trainer(plugin, steps: int = -1, **kw) -> L.Trainer:
    kw = {"max_steps": steps, "accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
          "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0, **kw}
    return L.Trainer(plugins=[plugin] if plugin is not None else [], **kw)


def loader(data) -> DataLoader:
    return DataLoader(data, batch_size=None, shuffle=False)


def fit(policy: str, data, steps: int, *, model: TinyGPT | None = None, ckpt_path=None, trainer_kw=None,
        **options) -> tuple[MixprecPrecision, L.Trainer, TinyGPT]:
    model = model or TinyGPT()
    plugin = MixprecPrecision(policy, **options)
    t = trainer(plugin, steps, **(trainer_kw or {}))
    t.fit(model, loader(data), ckpt_path=ckpt_path)
    return plugin, t, model


def assert_same_run(mp_a: MixedPrecision, mp_b: MixedPrecision) -> None:
    a, b = mp_a.trainable_state_dict(), mp_b.trainable_state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: fp32 values differ"
    for p, q in zip(mp_a.module.parameters(), mp_b.module.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q)
    assert (mp_a.applied_steps, mp_a.skipped_total, mp_a.boundaries) == (mp_b.applied_steps, mp_b.skipped_total,
                                                                          mp_b.boundaries)
    assert torch.equal(mp_a.loss_scale.scale, mp_b.loss_scale.scale)


# ---------------------------------------------------------------------- the engine's join (backward(join=True))
@pytest.mark.parametrize("policy", ["bf16-pure", "fp16-mixed"])
def test_join_adds_a_divided_loss_into_the_window_bit_for_bit(policy):
    """A trainer that divides the loss itself: accumulation_steps=1 and ``join=True`` on loss/2 equals
    accumulation_steps=2 on the loss (the engine divides), bit for bit."""
    data = batches(8)
    ref, _ = hand_loop(policy, data, accumulate=2)
    model = TinyGPT()
    mp = MixedPrecision(model, mixprec.optim.AdamW(model.parameters(), lr=1e-2), policy, device="cpu")
    for i, batch in enumerate(data):
        batch = mp.cast_inputs(batch)
        with mp.autocast():
            loss = model.training_step(batch, i)
        mp.backward(loss / 2, join=True)
        if i % 2 == 1:
            assert mp.step() is not None
    assert_same_run(mp, ref)
    # the boundary's mean loss: l1/2 + l2/2 against (l1 + l2)/2, equal bit for bit (halving is exact in binary)
    assert torch.equal(mp.boundary_loss, ref.boundary_loss)


# ---------------------------------------------------------------------- Trainer == the hand loop
@pytest.mark.parametrize("policy", PRESETS)
def test_trainer_equals_the_hand_loop_bit_for_bit(policy):
    data = batches(20)
    plugin, t, model = fit(policy, data, 20)
    ref, results = hand_loop(policy, data)
    assert_same_run(plugin.engine, ref)
    assert t.global_step == 20
    assert t.precision == str(plugin.engine.policy) == str(ref.policy) and t.precision.startswith(policy.split(",")[0])
    # the hook saw the unscaled gradients the engine stepped (fp32: the params' under -mixed, the masters' under
    # -pure; the 16-bit params' own where no master exists, which mixprec.optim steps in fp32), and their norm
    assert model.seen_checked
    fp32_grads = policy in ("bf16-mixed", "bf16-pure", "fp16-mixed")
    assert model.seen_dtypes == ({torch.float32} if fp32_grads else {torch.bfloat16})
    assert len(model.seen_norms) == len(results) == 20
    # torch's norm of fp32 grads is the engine's bit for bit; of bf16 grads upcast, the same sums of exact
    # squares in another order: each fp32 sum of n terms within n u (u = 2**-24), the sqrt halves it
    largest, count = model.seen_sizes
    rel = 0.0 if fp32_grads else (largest + count) * 2.0 ** -24
    for seen, result in zip(model.seen_norms, results):
        assert torch.equal(seen, result.grad_norm_t) if rel == 0 else \
            abs(float(seen) - result.grad_norm) <= rel * result.grad_norm


@pytest.mark.parametrize("policy", ["bf16-pure", "fp16-mixed"])
def test_accumulation_divides_once_bit_for_bit(policy):
    data = batches(20)
    plugin, t, _ = fit(policy, data, 10, trainer_kw={"accumulate_grad_batches": 2})
    ref, _ = hand_loop(policy, data, accumulate=2)
    assert_same_run(plugin.engine, ref)
    assert t.global_step == 10


def test_short_last_window_equals_lightning_fp32():
    """accumulate_grad_batches=3 on epochs of 10 batches (windows 3, 3, 3, 1) with a step scheduler: the
    plugin under the fp32 policy equals Lightning's own fp32 training bit for bit."""
    data = batches(10)
    plugin, _, _ = fit("fp32", data, -1, model=TinyGPT(scheduler=True),
                       trainer_kw={"accumulate_grad_batches": 3, "max_epochs": 2})
    plain = TinyGPT(scheduler=True)
    t = trainer(None, -1, accumulate_grad_batches=3, max_epochs=2, precision="32-true")
    t.fit(plain, loader(data))
    assert t.global_step == plugin.engine.boundaries == 8
    for p, q in zip(plugin.engine.module.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_gradient_clip_val_is_the_engines_fp32_clip():
    data = batches(10)
    plugin, _, _ = fit("fp16-mixed", data, 10, trainer_kw={"gradient_clip_val": 0.05})
    ref, results = hand_loop("fp16-mixed", data, clip=0.05)
    assert any(r.grad_norm > 0.05 for r in results)   # the clip acted
    assert_same_run(plugin.engine, ref)


def test_fp16_overflows_skip_and_the_scheduler_steps_on_applied_steps_only():
    data = batches(12)
    spikes = (2, 3, 7)
    plugin, t, _ = fit("fp16-mixed", data, 12, model=TinyGPT(scheduler=True, spikes=spikes))
    ref, results = hand_loop("fp16-mixed", data, model=TinyGPT(scheduler=True, spikes=spikes))
    engine = plugin.engine
    assert engine.skipped_total == len(spikes) and engine.applied_steps == 12 - len(spikes)
    assert [r.skipped_reason for r in results if not r.applied] == ["overflow"] * len(spikes)
    assert engine.scheduler.last_epoch == engine.applied_steps   # stepped after applied steps only
    assert engine.optimizer.param_groups[0]["lr"] == 1e-2 * lr_at(engine.applied_steps)
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == engine.applied_steps   # what Lightning shows
    assert_same_run(engine, ref)


# ---------------------------------------------------------------------- evaluation, before and after fit
@pytest.mark.parametrize("policy", ["bf16-pure", "fp16-mixed"])
def test_validate_test_predict_before_and_after_fit(policy):
    data, held_out = batches(10), batches(3, seed=5)
    model, plugin = TinyGPT(), MixprecPrecision(policy)
    t = trainer(plugin, 10)
    before = t.validate(model, loader(held_out), verbose=False)[0]["val_loss"]
    assert t.precision == str(plugin.engine.policy)
    t.fit(model, loader(data))
    after = t.validate(model, loader(held_out), verbose=False)[0]["val_loss"]
    tested = t.test(model, loader(held_out), verbose=False)[0]["val_loss"]
    predicted = t.predict(model, loader(held_out))
    untrained = MixedPrecision(TinyGPT(), None, policy, device="cpu")   # an evaluation engine
    trained, _ = hand_loop(policy, data)
    for ref, seen in ((untrained, before), (trained, after), (trained, tested)):
        with torch.no_grad(), ref.autocast():
            losses = [ref.module.loss(ref.cast_inputs(b)) for b in held_out]
        # Lightning's epoch mean of the logged losses: a weighted sum of 3 fp32 values
        assert seen == pytest.approx(float(torch.stack(losses).mean()), rel=4 * torch.finfo(torch.float32).eps)
    with torch.no_grad(), trained.autocast():
        ref_out = [trained.model(trained.cast_inputs(b)[0]) for b in held_out]
    for out, expected in zip(predicted, ref_out):
        assert out.dtype == expected.dtype == torch.float32 and torch.equal(out, expected)


# ---------------------------------------------------------------------- resume through Lightning's checkpoint
@pytest.mark.parametrize("policy", PRESETS + ["bf16-sr"])
def test_resume_through_ckpt_path_equals_an_uninterrupted_run(policy, tmp_path):
    """Two epochs of 10 batches (20 steps) against one epoch, ``trainer.save_checkpoint``, and a new model,
    plugin and Trainer resumed with ``fit(ckpt_path=...)`` for the second (an epoch boundary: Lightning
    replays a plain DataLoader from its start, so a mid-epoch checkpoint would see other batches)."""
    data = batches(10)
    spikes = (3, 7) if policy == "fp16-mixed" else ()   # skipped steps on each side of the checkpoint
    whole, _, _ = fit(policy, data, -1, model=TinyGPT(scheduler=True, spikes=spikes), trainer_kw={"max_epochs": 2})
    first, t1, _ = fit(policy, data, -1, model=TinyGPT(scheduler=True, spikes=spikes), trainer_kw={"max_epochs": 1})
    path = tmp_path / "first.ckpt"
    t1.save_checkpoint(path)
    resumed, t2, _ = fit(policy, data, -1, model=TinyGPT(scheduler=True, spikes=spikes), ckpt_path=path,
                         trainer_kw={"max_epochs": 2})
    assert t2.global_step == 20 and first.engine.boundaries == 10
    assert_same_run(resumed.engine, whole.engine)
    assert resumed.engine.scheduler.last_epoch == whole.engine.scheduler.last_epoch
    assert [e.to_dict() for e in resumed.engine.events] == [e.to_dict() for e in whole.engine.events]
    if spikes:
        assert whole.engine.skipped_total == 4


def test_a_pure_checkpoint_holds_the_fp32_masters_so_a_plain_load_gets_the_trained_weights(tmp_path):
    """Under bf16-pure Lightning's ``state_dict`` held the params' bf16 rounding (up to one bf16 ulp off the
    trained fp32 weights) for ``load_from_checkpoint`` without the plugin; it holds the masters now (the resume
    through the plugin stays bit-exact: test above)."""
    first, t1, _ = fit("bf16-pure", batches(4), -1, trainer_kw={"max_epochs": 1})
    path = tmp_path / "pure.ckpt"
    t1.save_checkpoint(path)
    plain = TinyGPT()   # fp32, no plugin
    plain.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    trained = first.engine.trainable_state_dict()
    for name, p in plain.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), trained[name]), name
    assert any(not torch.equal(trained[n], p.float()) for n, p in first.engine.module.named_parameters())   # bf16 != fp32


# ---------------------------------------------------------------------- manual optimization
class ManualGPT(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.loss(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        return loss.detach()


def test_manual_optimization_steps_through_the_engine():
    data = batches(10)
    plugin, t, _ = fit("bf16-pure", data, 10, model=ManualGPT())
    ref, _ = hand_loop("bf16-pure", data)
    assert t.global_step == 10   # max_steps is honoured
    assert_same_run(plugin.engine, ref)


class ManualClippedGPT(ManualGPT):
    """Manual optimization clipping as documented: ``self.clip_gradients`` in ``on_before_optimizer_step``
    (inside ``opt.step()``, on the engine's unscaled gradients); ``early``: in ``training_step`` instead."""

    def __init__(self, early: bool = False) -> None:
        super().__init__()
        self.early = early

    def training_step(self, batch, batch_idx):
        if not self.early:
            return super().training_step(batch, batch_idx)
        self.manual_backward(self.loss(batch, batch_idx))
        self.clip_gradients(self.optimizers(), gradient_clip_val=0.05, gradient_clip_algorithm="norm")

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


def test_manual_optimization_clips_in_on_before_optimizer_step():
    data = batches(6)
    plugin, _, _ = fit("fp16-mixed", data, 6, model=ManualClippedGPT())
    ref, results = hand_loop("fp16-mixed", data, clip=0.05)
    assert any(r.grad_norm > 0.05 for r in results)   # the clip acted
    assert_same_run(plugin.engine, ref)
    with pytest.raises(RuntimeError, match=r"In manual optimization call self.clip_gradients.*on_before_optimizer_step"):
        fit("fp16-mixed", data[:1], 1, model=ManualClippedGPT(early=True))


# ---------------------------------------------------------------------- refusals
def test_options_the_trainer_owns_are_refused_by_name():
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        MixprecPrecision("bf16-mixed", accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_clip_val"):
        MixprecPrecision("bf16-mixed", max_grad_norm=1.0)


class TwoOptimizers(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        return [mixprec.optim.AdamW(self.gpt.blocks.parameters()), mixprec.optim.AdamW(self.gpt.ln_f.parameters())]


def test_several_optimizers_are_refused_by_name():
    """Manual optimization with two optimizers (a GAN's shape): param groups would step both networks from each
    loss, so the refusal names what a GAN needs (one engine per network), not only param groups."""
    with pytest.raises(ValueError, match=r"one optimizer.*param groups.*a GAN.*one MixedPrecision per network"):
        fit("bf16-mixed", batches(2), 2, model=TwoOptimizers())


# ---------------------------------------------------------------------- DDP: 2 gloo processes
class _Wrapper(L.Callback):
    """What the strategy trains at the first step: the wrapper's type and its params' dtypes."""

    def on_train_start(self, trainer, pl_module):
        self.wrapped = type(trainer.strategy.model).__name__
        self.dtypes = sorted({str(p.dtype) for p in trainer.strategy.model.parameters()})
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(batch[0].clone())


class SGDGPT(TinyGPT):
    """SGD: the update is the gradient times lr, so gradient rounding bounds it (Adam's normalised steps would
    turn bf16 noise in near-zero gradients into full-size differences)."""

    def configure_optimizers(self):
        return mixprec.optim.SGD(self.parameters(), lr=0.05)


def _ddp_rank(rank: int, port: int, out: str, policy: str, accumulate: int, sgd_steps: int = 0) -> None:
    """One rank of ``strategy="ddp"`` (torchrun's environment, so Lightning launches nothing itself)."""
    import os
    import traceback
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        torch.manual_seed(rank)   # different inits: the plugin broadcasts rank 0's fp32 values before casting
        model = SGDGPT() if sgd_steps else TinyGPT()
        if rank == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
        plugin, witness = MixprecPrecision(policy), _Wrapper()
        t = trainer(plugin, sgd_steps or 10, strategy="ddp", devices=2, callbacks=[witness],
                    accumulate_grad_batches=accumulate, use_distributed_sampler=False)
        t.fit(model, loader(batches(20)[rank::2]))   # rank r: batches r, r + 2, ... (global step i: 2i and 2i + 1)
        torch.save({"fp32": plugin.engine.trainable_state_dict(), "applied": plugin.engine.applied_steps,
                    "wrapped": witness.wrapped, "dtypes": witness.dtypes, "seen": witness.seen},
                   os.path.join(out, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ddp(tmp_path, policy: str, accumulate: int = 1, sgd_steps: int = 0) -> list | str:
    """Both ranks' results, or the text of the ranks' errors."""
    import socket
    import time
    import torch.multiprocessing as torch_mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch_mp.start_processes(_ddp_rank, args=(port, str(tmp_path), policy, accumulate, sgd_steps), nprocs=2, join=False,
                                   start_method="spawn")
    deadline = time.monotonic() + 240
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail("ranks still running after 240 s: a collective hangs")
    except torch_mp.ProcessRaisedException:
        return "\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.err")))
    finally:
        for proc in ctx.processes:   # only the processes this test started
            if proc.is_alive():
                proc.kill()
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


# bf16-pure in the default set; bf16-lean (8-bit state) under the plugin is test_trainer_equals_the_hand_loop_bit_for_bit's
# in one process, and its 2-rank DDP case is slow
@pytest.mark.parametrize("policy", ["bf16-pure", pytest.param("bf16-lean,kernels=native", marks=pytest.mark.slow)])
def test_ddp_two_ranks_keep_identical_masters(policy, tmp_path):
    ranks = run_ddp(tmp_path, policy)
    assert not isinstance(ranks, str), f"a rank raised:\n{ranks}"
    for r in ranks:
        assert r["wrapped"] == "DistributedDataParallel" and r["applied"] == 10
        assert r["dtypes"] == ["torch.bfloat16"]   # DDP wrapped the prepared (16-bit) params
    assert ranks[0]["fp32"].keys() == ranks[1]["fp32"].keys()
    for name, value in ranks[0]["fp32"].items():
        assert torch.equal(value, ranks[1]["fp32"][name]), f"{name}: the ranks' fp32 values differ"


def test_ddp_equals_one_process_on_the_global_batch(tmp_path):
    """bf16-pure, SGD, 4 steps: 2 ranks of 2 sequences each against one process on their 4. The runs round
    in different places: each gradient goes through about 4 bf16 roundings (forward output, its gradient,
    the input and weight gradients) and DDP's bf16 all-reduce adds 2 (the sum, the division), each within
    u = eps_bf16 / 2, so the two updates differ by at most 2 * 6 * u = 6 * eps_bf16 relative (the whole
    update as one vector; the reasoning of tests/distributed/test_distributed.py; measured 4.5e-3 against 4.7e-2)."""
    steps = 4
    ranks = run_ddp(tmp_path, "bf16-pure", sgd_steps=steps)
    assert not isinstance(ranks, str), f"a rank raised:\n{ranks}"
    data = batches(2 * steps)
    global_batches = [tuple(torch.cat([a, b]) for a, b in zip(data[2 * i], data[2 * i + 1])) for i in range(steps)]
    start = MixedPrecision(SGDGPT(), None, "fp32", device="cpu").trainable_state_dict()
    one, _ = hand_loop("bf16-pure", global_batches, model=SGDGPT())
    delta_one = torch.cat([(v - start[n]).flatten() for n, v in one.trainable_state_dict().items()])
    delta_ddp = torch.cat([(v - start[n]).flatten() for n, v in ranks[0]["fp32"].items()])
    eps_bf16 = torch.finfo(torch.bfloat16).eps
    for i in range(steps):   # the global batch of step i: rank 0's batch 2i and rank 1's batch 2i + 1
        assert torch.equal(ranks[0]["seen"][i], data[2 * i][0])
        assert torch.equal(ranks[1]["seen"][i], data[2 * i + 1][0])
    assert float((delta_ddp - delta_one).norm() / delta_one.norm()) <= 6 * eps_bf16


def test_ddp_accumulation_with_masters_is_refused_by_name(tmp_path):
    errors = run_ddp(tmp_path, "bf16-pure", accumulate=2)
    assert isinstance(errors, str) and "ValueError: accumulate_grad_batches=2 on 2 processes" in errors


# ---------------------------------------------------------------------- Fabric
def fabric_run(policy: str, data, *, model: TinyGPT | None = None, start: int = 0, load=None, save=None,
               clip: float | None = None, step_scheduler: bool = False):
    """``fabric.setup`` + ``plugin.attach`` + Fabric's own loop on ``data`` (batch indices from ``start``);
    ``load``/``save``: a path for ``fabric.load``/``fabric.save`` of ``{"mixprec": plugin}``;
    ``step_scheduler``: the user also calls ``scheduler.step()`` after each ``optimizer.step()``."""
    from mixprec.integrations.lightning import MixprecFabricPrecision
    model = model or TinyGPT()
    plugin = MixprecFabricPrecision(policy)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    configured = model.configure_optimizers()
    opt, sched = (configured["optimizer"], configured["lr_scheduler"]["scheduler"]) if isinstance(configured, dict) \
        else (configured, None)
    fmodel, fopt = fabric.setup(model, opt)
    plugin.attach(fopt, sched)
    if load is not None:
        fabric.load(load, {"mixprec": plugin})
    for i, (idx, tgt) in enumerate(loader(data), start):
        loss = F.cross_entropy(fmodel(idx).float().flatten(0, 1), tgt.flatten())
        fabric.backward(loss * 1e5 if i in model.spikes else loss)
        if clip is not None:
            fabric.clip_gradients(fmodel, fopt, max_norm=clip, error_if_nonfinite=False)
        fopt.step()
        if step_scheduler:
            sched.step()
    if save is not None:
        fabric.save(save, {"mixprec": plugin})
    return plugin, fabric


@pytest.mark.parametrize("policy", ["bf16-pure", "fp16-mixed", "bf16-lean,kernels=native"])
def test_fabric_equals_the_hand_loop_bit_for_bit(policy):
    data = batches(20)
    plugin, fabric = fabric_run(policy, data)
    ref, _ = hand_loop(policy, data)
    assert_same_run(plugin.engine, ref)
    assert plugin.precision == str(ref.policy)


def test_fabric_clip_gradients_clips_the_unscaled_gradients():
    data = batches(10)
    plugin, _ = fabric_run("fp16-mixed", data, clip=0.05)
    ref, results = hand_loop("fp16-mixed", data, clip=0.05)
    assert any(r.grad_norm > 0.05 for r in results)   # the clip acted
    assert_same_run(plugin.engine, ref)


def test_fabric_skips_overflows_and_resumes_exactly(tmp_path):
    """fp16 overflows forced on both sides of a ``fabric.save``; the scheduler steps on applied steps only, and
    10 + 10 steps through ``fabric.load`` equal 20 (the hand loop's) bit for bit."""
    data, spikes = batches(20), (2, 3, 14)
    path = tmp_path / "fabric.ckpt"
    fabric_run("fp16-mixed", data[:10], model=TinyGPT(scheduler=True, spikes=spikes), save=path)
    plugin, _ = fabric_run("fp16-mixed", data[10:], model=TinyGPT(scheduler=True, spikes=spikes), start=10, load=path)
    ref, _ = hand_loop("fp16-mixed", data, model=TinyGPT(scheduler=True, spikes=spikes))
    engine = plugin.engine
    assert engine.skipped_total == 3 and engine.scheduler.last_epoch == engine.applied_steps == 17
    assert_same_run(engine, ref)


def test_fabric_a_users_own_step_of_the_attached_scheduler_is_refused():
    """``plugin.attach(optimizer, scheduler)`` hands the scheduler to the engine; the user's ``scheduler.step()``
    as well would move the learning rate twice per step: refused at the next ``fabric.backward``."""
    with pytest.raises(RuntimeError, match=r"LambdaLR.step\(\) was called 1 time\(s\) outside the engine"):
        fabric_run("bf16-mixed", batches(3), model=TinyGPT(scheduler=True), step_scheduler=True)


class SkipsBatches(TinyGPT):
    """``training_step`` returns None on the given batches: Lightning skips their optimizer step."""

    def __init__(self, skip: tuple[int, ...]) -> None:
        super().__init__()
        self.skip = skip

    def training_step(self, batch, batch_idx):
        return None if batch_idx in self.skip else super().training_step(batch, batch_idx)


def test_a_none_training_step_steps_as_lightning_fp32_does():
    """Windows of 2; batches 2 and 3 (a whole window) and 4 (a window's first) return None: the window of
    2-3 has no gradient and no step, the one of 4-5 steps batch 5 alone, as Lightning's fp32 training does."""
    data = batches(8)
    plugin, _, _ = fit("fp32", data, -1, model=SkipsBatches((2, 3, 4)),
                       trainer_kw={"accumulate_grad_batches": 2, "max_epochs": 1, "gradient_clip_val": 1.0})
    plain = SkipsBatches((2, 3, 4))
    trainer(None, -1, accumulate_grad_batches=2, max_epochs=1, gradient_clip_val=1.0, precision="32-true").fit(
        plain, loader(data))
    assert plugin.engine.boundaries == 3
    for p, q in zip(plugin.engine.module.parameters(), plain.parameters()):
        assert torch.equal(p, q)


class _Regression(L.LightningModule):
    """(x, y) float batches, an MSE loss; records the dtype each step's and prediction's ``y`` arrives in."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.y_dtypes = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.y_dtypes.append(y.dtype)
        return torch.nn.functional.mse_loss(self.net(x).float().squeeze(-1), y)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_keep_inputs_keeps_float_targets_out_of_the_param_dtype():
    """Under bf16-pure the batch's floats are cast to bf16; a float target given in ``keep_inputs`` reaches the
    loss as it came (fp32: rounded to bf16, 1 + 2**-10 would read 1.0); a predict batch without the target
    still runs. Bad ``keep_inputs`` is a TypeError naming the form. Failed before: no keep_inputs option."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, generator=g), torch.tensor(1.0 + 2.0 ** -10)) for _ in range(8)]
    for keep, want in (((), torch.bfloat16), ((1,), torch.float32)):
        model, plugin = _Regression(), MixprecPrecision("bf16-pure", keep_inputs=keep)
        trainer = L.Trainer(plugins=[plugin], max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
        assert set(model.y_dtypes) == {want}, keep
        out = trainer.predict(model, torch.utils.data.DataLoader([(x,) for x, _ in data], batch_size=4))
        assert out[0].dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"keep_inputs='y'.*keep_inputs=\(1,\)"):
        MixprecPrecision("bf16-pure", keep_inputs="y")


def test_fabric_load_of_an_open_window_under_another_policy_names_the_policy_to_resume_with(tmp_path):
    """A window saved open under bf16-kahan cannot be converted to bf16-sr (its gradients are bf16-kahan's); the
    refusal said "pass convert=True ... or adopt_policy=True" (load_state_dict's arguments, which fabric.load does
    not take); it names the plugin and the saved policy to resume with."""
    from mixprec.integrations.lightning import MixprecFabricPrecision

    def setup(policy: str):
        plugin = MixprecFabricPrecision(policy)
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = TinyGPT()
        fmodel, fopt = fabric.setup(model, model.configure_optimizers())
        plugin.attach(fopt)
        return plugin, fabric, fmodel

    plugin, fabric, fmodel = setup("bf16-kahan")
    idx, tgt = next(iter(loader(batches(1))))
    fabric.backward(F.cross_entropy(fmodel(idx).float().flatten(0, 1), tgt.flatten()) / 2)   # no step: window open
    fabric.save(tmp_path / "window.ckpt", {"mixprec": plugin})
    plugin, fabric, _ = setup("bf16-sr")
    with pytest.raises(ValueError, match=r"MixprecFabricPrecision\('bf16-sr'\) resuming a checkpoint saved under "
                                         r"MixprecFabricPrecision\('bf16-kahan'\).*resume with "
                                         r"MixprecFabricPrecision\('bf16-kahan'\)"):
        fabric.load(tmp_path / "window.ckpt", {"mixprec": plugin})


def test_a_new_trainer_on_a_fitted_model_takes_over_the_earlier_engine():
    """Another Trainer's test() after fit (a new plugin, the earlier engine out of reach): the earlier engine is
    unwrapped, its fp32 values restored from the masters, and the new run records the hand-over; the test loss
    is the trained model's."""
    data, held_out = batches(6), batches(3, seed=5)
    plugin, _, model = fit("bf16-pure", data, 6)
    masters = {n: m.clone() for n, m in plugin.engine.masters.named(model.named_parameters()).items()}
    second = MixprecPrecision("bf16-mixed")
    with pytest.warns(UserWarning, match=r"MixprecPrecision: this model was still prepared by an earlier "
                                         r"MixedPrecision engine \(policy bf16-pure.*fp32 values restored"):
        tested = trainer(second).test(model, loader(held_out), verbose=False)[0]["val_loss"]
    named = dict(model.named_parameters())
    assert masters and all(named[n].dtype == torch.float32 and torch.equal(named[n], m) for n, m in masters.items())
    assert [e.kind for e in second.engine.events] == ["handover"]
    with torch.no_grad(), second.engine.autocast():
        losses = [model.loss(second.engine.cast_inputs(b)) for b in held_out]
    assert tested == pytest.approx(float(torch.stack(losses).mean()), rel=4 * torch.finfo(torch.float32).eps)
