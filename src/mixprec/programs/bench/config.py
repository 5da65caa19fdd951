"""What one ``mixprec bench`` run is asked to do: :class:`BenchConfig` and the defaults it starts from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mixprec.memory.batch_budget import parse_bytes
from mixprec.programs.bench.recompute_rows import check_recompute_rows
from mixprec.programs.bench.verdict import Targets

__all__ = ["BenchConfig", "DEFAULT_POLICIES", "DEFAULT_STEPS", "DEFAULT_GPT_CONFIG", "REFERENCE", "TIMING_METHODS"]

DEFAULT_POLICIES = ("fp32", "bf16-mixed", "bf16-pure", "bf16-kahan", "bf16-sr")
DEFAULT_STEPS = 300
DEFAULT_GPT_CONFIG = "mid"
REFERENCE = "fp32"   # the row every other row is compared with: it always runs, first
TIMING_METHODS = ("interleaved", "sequential")   # BenchConfig.timing: how step times are measured


@dataclass(frozen=True)
class BenchConfig:
    """Everything one bench run needs (the CLI builds it from its flags).

    ``config=None`` means ``mid`` for the ``gpt`` workload and the workload's own default
    otherwise; ``steps=None`` the workload's ``default_steps`` (300 for gpt). ``lora`` (e.g.
    ``"r=8,alpha=16,targets=query,value"``) fine-tunes LoRA adapters on a transformers workload. ``command`` is the exact command line, recorded in the outputs. ``strategy``
    (``"ddp"``, ``"fsdp2"``): run under torchrun, one runner per rank (see :func:`~mixprec.programs.bench.runner.run_bench`). ``compile``: each
    policy also runs compiled (``MixedPrecision(..., compile=True)``, inductor) in its own worker, as
    the row ``<policy>+compiled`` (:data:`mixprec.programs.bench.results.COMPILED_SUFFIX`), judged against eager fp32 like the others;
    its compilation time is reported apart from its step time. ``timing``: ``"interleaved"`` (default: one pass,
    every row trains in its own resident worker and the workers take turns a block of steps at a time,
    :mod:`mixprec.programs.bench.turns`, so each row's quality steps are also its timed steps, interleaved with the
    others') or ``"sequential"`` (one row after the other, each timed on its own steps; always under a strategy).
    ``seeds``: the fp32 reference also trains at ``seeds - 1`` more seeds (``seed + 1``, ...): the spread of its
    final eval loss is the seed-noise band each verdict is read against (1: none; not under a strategy).
    ``eval_every``: every policy also measures its validation loss after every K-th step (its ``eval_curve``);
    None: :func:`~mixprec.programs.bench.schedule.eval_every_for` (about ten points), 0: only the final eval. ``memory_budget`` (``"4GiB"``):
    each policy also reports the largest batch whose peak live tensor bytes fit it (None: not measured).
    ``recompute``: the engine's ``recompute=`` for the ``<policy>+recompute`` rows named in ``policies``
    (:mod:`mixprec.programs.bench.recompute_rows`; ``"auto"`` (None), ``"auto:1.5"``, ``"blocks.*"``, ...; refused
    without such a row, and at :func:`~mixprec.programs.bench.runner.run_bench` before any training when it names blocks the model lacks).
    ``peer``: also train and time the plain-``torch.autocast`` loop a user would write instead, as the row
    ``torch-autocast`` (:mod:`mixprec.programs.bench.peer`; every row gets its speed and saved bytes against it);
    False: ``--no-peer``. ``quick``: a smoke test (``--quick``): :data:`~mixprec.programs.bench.schedule.QUICK_STEPS` steps unless ``steps`` is given,
    no step profiles, and no verdict better than ``SMOKE`` (what it did not establish is said). ``portable_cost``: also
    time ``ops=portable`` against ``ops=native`` (:mod:`mixprec.programs.bench.portable_cost`). ``fresh_seed_band``: train
    the extra seeds again instead of reusing the runs kept for this workload and machine
    (:mod:`mixprec.programs.bench.seed_band`).
    """

    out: Path
    workload: str = "gpt"
    config: str | None = None
    policies: tuple[str, ...] = DEFAULT_POLICIES
    steps: int | None = None
    seed: int = 0
    data: str | None = None
    device: str | None = None
    force: bool = False
    targets: Targets = field(default_factory=Targets)
    command: str = ""
    strategy: str | None = None
    lora: str | None = None
    compile: bool = False
    timing: str = "interleaved"
    seeds: int = 2
    eval_every: int | None = None
    memory_budget: str | None = None
    recompute: str | None = None
    peer: bool = True
    quick: bool = False
    portable_cost: bool = False
    fresh_seed_band: bool = False

    def __post_init__(self) -> None:
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget, name="bench memory_budget")   # ValueError naming it and the units
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1:
            raise ValueError(f"bench seeds={self.seeds!r} must be an int >= 1 (1: no seed-noise band)")
        if self.eval_every is not None and (isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int)
                                            or self.eval_every < 0):
            raise ValueError(f"bench eval_every={self.eval_every!r} must be an int >= 0 (0: only the final eval) "
                             "or None (about ten eval points per run)")
        if self.timing not in TIMING_METHODS:
            raise ValueError(f"bench timing={self.timing!r} is not allowed; choose one of {TIMING_METHODS}")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 5):
            raise ValueError(f"bench steps={self.steps!r} must be an int >= 5 (warm-up steps are not timed)")
        if self.compile and self.strategy is not None:
            raise ValueError(f"bench compile=True with strategy={self.strategy!r}: the engine does not compile a "
                             "DDP/FSDP2-wrapped model; drop --compile or --strategy")
        if not self.policies or not all(isinstance(p, str) and p.strip() for p in self.policies):
            raise ValueError(f"bench policies={self.policies!r} must be non-empty policy names, "
                             f"e.g. {','.join(DEFAULT_POLICIES)}")
        check_recompute_rows(self.recompute, self.policies)   # a bad value, or a plan no row uses: ValueError

    @property
    def config_name(self) -> str | None:
        return DEFAULT_GPT_CONFIG if self.config is None and self.workload == "gpt" else self.config
