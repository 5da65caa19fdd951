"""Which rows a bench runs: the policies asked for (``advised`` and ``advised:<block format>`` replaced by the
policies the inspection advises: :mod:`mixprec.programs.bench.advised_rows`), checked, and why the device refuses
each one it cannot run (SKIPPED).

fp32 always runs, first, as the reference. Each other policy is resolved for the device with the measured
capability (:func:`mixprec.policy.resolve.resolve`); a policy the device refuses, and fp16 on a CPU whose probe
says fp16 is not native, is SKIPPED with the measured reason unless ``force=True``. A policy name that does not
parse is an error, not a SKIPPED row: only the device may refuse; so is a plan whose every policy besides fp32 is
SKIPPED (nothing would be compared). Under a strategy every rank follows rank 0's plan.

Testing hook, read ONLY here: ``MIXPREC_BENCH_CAPABILITY`` (:data:`CAPABILITY_ENV`) holds a JSON object of
:class:`mixprec.machine.capability.Capability` fields that replaces the measured probe when planning
(``{"device": "cpu", "bf16": true, "fp16": true, "bf16_fast": true, "fp16_native": false, "detail":
"..."}`` makes fp16 SKIPPED on any CPU); the workers still run with the real device.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from mixprec.distributed.process import from_main_process, init_process_group_from_env, is_main_process
from mixprec.machine.capability import Capability, probe
from mixprec.policy.policy import Policy
from mixprec.policy.resolve import resolve
from mixprec.programs.bench.advised_rows import AdvisedRows, advise_rows, check_requests, is_advised, merged_rows
from mixprec.programs.bench.config import REFERENCE, BenchConfig
from mixprec.programs.bench.recompute_rows import RECOMPUTE_SUFFIX, check_plan_fits, split_row

__all__ = ["CAPABILITY_ENV", "capability_for", "plan_policy", "plan_rows"]

CAPABILITY_ENV = "MIXPREC_BENCH_CAPABILITY"


def capability_for(device: torch.device, capability: Capability | None) -> Capability:
    """``capability`` when given (tests), else the one :data:`CAPABILITY_ENV` holds, else the device's measured probe.

    Raises:
        ValueError: :data:`CAPABILITY_ENV` set to something other than a JSON object of Capability fields.
    """
    if capability is not None:
        return capability
    text = os.environ.get(CAPABILITY_ENV)
    if text:
        try:
            return Capability(**json.loads(text))
        except (ValueError, TypeError) as err:
            raise ValueError(f"{CAPABILITY_ENV}={text!r} is not a JSON object of Capability fields "
                             f"({list(Capability.__dataclass_fields__)}): {err}") from None
    return probe(device)


def plan_policy(spec: str, device: torch.device, capability: Capability, *, force: bool) -> str | None:
    """Why ``spec`` is SKIPPED on ``device`` (None: it runs). ``force`` runs non-native fp16."""
    try:
        policy = resolve(spec, device, capability=capability).policy
    except ValueError as err:
        return str(err)
    fp16 = torch.float16 in (policy.param_dtype, policy.compute_dtype)
    if fp16 and device.type == "cpu" and not capability.fp16_native and not force:
        return (f"fp16 is not native on this CPU ({capability.detail or 'measured: fp16 matmul far slower than fp32'}); "
                "it would run emulated and slowly: pass --force to run it anyway")
    return None


def _advised(config: BenchConfig, names: list[str], device: torch.device, progress: bool
             ) -> tuple[list[str], dict | None]:
    """``names`` with each advised request (``advised``, ``advised:<format>``, either with ``+recompute``) replaced
    by its advised policy, and the advice's record; rank 0 inspects and every rank follows it under a strategy."""
    asked = list(dict.fromkeys(split_row(n)[0] for n in names if is_advised(split_row(n)[0])))
    if not asked:
        return names, None
    check_requests(asked)   # every rank: a bad request fails everywhere before anything runs
    rows: AdvisedRows | str | None = None
    if is_main_process():
        from mixprec.numerics.workload import inspect_workload
        try:
            rows = advise_rows(asked, inspect_workload, workload=config.workload, config=config.config_name,
                               data=config.data, device=device, lora=config.lora)
        except (ValueError, TypeError, ImportError) as err:
            rows = f"{type(err).__name__}: {err}"
    rows = from_main_process(rows)
    if isinstance(rows, str):
        raise ValueError(f"--policies {','.join(asked)}: rank 0's inspection failed: {rows}")
    if progress and is_main_process():
        for request, policy in rows.names.items():
            print(f"{request}: {policy}\n  " + "\n  ".join(rows.reasons(request)), file=sys.stderr)
    row = {n: rows.names[split_row(n)[0]] + (RECOMPUTE_SUFFIX if split_row(n)[1] else "")
           for n in names if split_row(n)[0] in rows.names}
    merged = merged_rows(names, row)   # an advised policy some other request also names runs once
    return list(dict.fromkeys(row.get(n, n) for n in names)), {**rows.record, **({"merged": merged} if merged else {})}


def plan_rows(config: BenchConfig, device: torch.device, cap: Capability, progress: bool
              ) -> tuple[list[str], dict[str, str | None], dict | None]:
    """The rows' policy names (fp32 first, each advised request replaced by its advised policy), why each is
    SKIPPED (None: it runs; rank 0's plan under a strategy) and results.json's ``advice`` (None unless asked)."""
    if config.strategy is not None:
        init_process_group_from_env("cpu")   # the runners' own group: plans and ports, never tensors
    names = list(dict.fromkeys([REFERENCE, *(p.strip() for p in config.policies)]))
    names, advice = _advised(config, names, device, progress)
    for name in names:  # a typo is an error, not a SKIPPED policy: only the device may refuse
        if split_row(name)[0].lower() != "auto":
            Policy.parse(split_row(name)[0])
    if any(split_row(n)[1] for n in names):   # named blocks the model lacks: bad input, not a SKIPPED row
        check_plan_fits(config)
    skip = {name: plan_policy(split_row(name)[0], device, cap, force=config.force) for name in names}
    if config.strategy is not None:
        skip = from_main_process(skip)       # every rank runs the same policies in the same order
    if skip[REFERENCE] is not None:
        raise ValueError(f"the fp32 reference cannot run on {device}: {skip[REFERENCE]}")
    _check_a_row_runs(names, skip, device)
    return names, skip, advice


def _check_a_row_runs(names: list[str], skip: dict[str, str | None], device: torch.device) -> None:
    """ValueError when every policy asked for besides the reference is SKIPPED: the bench would compare nothing
    with fp32 (the peer is not asked for by name); an fp32-only bench is fine."""
    asked = [n for n in names if n != REFERENCE]
    if asked and all(skip[n] is not None for n in asked):
        raise ValueError(f"--policies {','.join(asked)}: every policy asked for would be SKIPPED on {device}, so "
                         "nothing would be compared with fp32: " + "; ".join(f"{n}: {skip[n]}" for n in asked)
                         + "; ask for a policy this device runs, or pass --force where the reason allows it")
