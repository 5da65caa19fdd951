"""``mixprec bench``: policies side by side with fp32 on a real workload, with verdicts.

:func:`run_bench` runs a :class:`BenchConfig` (one subprocess per policy, fp32 first) and writes
``results.json``, ``report.md``, ``loss_curves.png``, ``loss_wallclock.png`` and ``speed_memory.png``, and returns the run as a
:class:`BenchResults` of :class:`PolicyRun` rows.
"""

from mixprec.programs.bench.results import BenchResults, PolicyRun
from mixprec.programs.bench.runner import DEFAULT_POLICIES, DEFAULT_STEPS, BenchConfig, run_bench
from mixprec.programs.bench.verdict import Targets, Verdict, judge

__all__ = ["BenchConfig", "BenchResults", "PolicyRun", "DEFAULT_POLICIES", "DEFAULT_STEPS", "Targets", "Verdict", "judge", "run_bench"]
