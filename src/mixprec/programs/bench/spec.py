"""What one bench worker runs: :class:`RunSpec`, written as JSON by the runner and read by the quality worker
(:mod:`mixprec.programs.bench.worker`) and the resident timing worker (:mod:`mixprec.programs.bench.interleaved`)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RunSpec"]


@dataclass(frozen=True)
class RunSpec:
    """What one worker runs (JSON-serialised by the runner).

    ``peaks_gflops`` maps ``fp32``/``bf16``/``fp16`` to the doctor's measured matmul peak
    (GFLOP/s) for MFU; ``measure_state_at`` is the 0-based step after whose backward the
    training-state bytes are read (>= 1, so optimizer state exists). ``strategy`` (``"ddp"``,
    ``"fsdp2"``): this worker is one rank of a torch.distributed run (environment as torchrun
    sets it); it trains on its share of the batches, and ``items_per_s``, ``tokens_per_s`` and
    ``gflops_per_s`` are summed over the ranks (``mfu`` against ``world_size`` × the peak).
    ``compile``: the engine compiles the model (``MixedPrecision(..., compile=True)``, inductor);
    compilation runs in the first step, which the warm-up keeps out of the step-time median.
    ``eval_every`` K > 0: the validation loss is also measured after every K-th step (outside the step
    timing; it changes nothing in training), giving the row's ``eval_curve``; 0: only the final eval.
    ``op_plan``: the bench's one attention plan for this policy (key -> candidate, measured once by the runner:
    :mod:`mixprec.programs.bench.pinned_plan`), pinned before the engine is built; empty: the worker plans itself.
    ``memory_budget`` (``"4GiB"``): also the largest batch whose predicted peak live bytes fit it
    (:func:`mixprec.programs.bench.step_memory.measure_batch_budget`); None: not measured.
    ``recompute``: the engine's recompute option (``MixedPrecision(recompute=...)``: ``"auto"``, names), None:
    none; the row then carries the plan its engine ran (:mod:`mixprec.programs.bench.recompute_rows`).
    ``autocast_dtype`` (``"bfloat16"``, ``"float16"``): set on the plain-autocast peer's spec only (``policy`` is then
    :data:`mixprec.programs.bench.peer.PEER`): the dtype its ``torch.autocast`` runs in, decided by the runner.
    """

    workload: str
    policy: str
    steps: int
    seed: int = 0
    config: str | None = None
    data: str | None = None
    device: str | None = None
    warmup_steps: int = 2
    measure_state_at: int = 1
    peaks_gflops: dict[str, float | None] = field(default_factory=dict)
    strategy: str | None = None
    lora: str | None = None
    compile: bool = False
    eval_every: int = 0
    op_plan: dict[str, str] = field(default_factory=dict)
    memory_budget: str | None = None
    recompute: str | list[str] | None = None
    autocast_dtype: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ValueError(f"RunSpec eval_every={self.eval_every!r} must be an int >= 0 (0: only the final eval)")
        if not (isinstance(self.steps, int) and self.steps > self.warmup_steps >= self.measure_state_at >= 1):
            raise ValueError(f"RunSpec steps={self.steps!r}, warmup_steps={self.warmup_steps!r}, "
                             f"measure_state_at={self.measure_state_at!r} must satisfy "
                             "steps > warmup_steps >= measure_state_at >= 1")
        if self.autocast_dtype not in (None, "bfloat16", "float16"):
            raise ValueError(f"RunSpec autocast_dtype={self.autocast_dtype!r} must be 'bfloat16', 'float16' or None "
                             "(None: a mixprec policy's row, not the peer's)")
