"""mixprec.safety: the guard's knobs, checked as it is built (GuardConfig), and the escalation ladder (next_policy).

The guard's behaviour on real runs, rollbacks and escalations included, is tests/test_guard.py's.
"""

import pytest

import mixprec
from mixprec import Guard
from mixprec.safety.escalation import next_policy


@pytest.mark.parametrize("kwargs,match", [
    ({"snapshot_every": 0}, r"Guard snapshot_every=0 is not allowed; it must be an int >= 1; e.g. snapshot_every=50"),
    ({"check_every": 1.5}, r"Guard check_every=1.5 is not allowed"),
    ({"spike_factor": 1.0}, r"spike_factor=1.0 is not allowed; it must be None \(off\) or a finite number > 1"),
    ({"spike_zscore": -1}, r"spike_zscore=-1 is not allowed"),
    ({"spike_warmup": 1}, r"spike_warmup=1 is not allowed; it must be an int >= 2"),
    ({"spike_warmup": 60}, r"spike_warmup=60 is not allowed; it must be an int in \[2, spike_window=50\]"),
    ({"max_rollbacks": -1}, r"max_rollbacks=-1 is not allowed; it must be an int >= 0"),
    ({"escalate_after": True}, r"escalate_after=True is not allowed"),
])
def test_bad_guard_arguments_name_the_argument_value_and_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Guard(**kwargs)



# ---------------------------------------------------------------- the escalation ladder
@pytest.mark.parametrize("policy,module,bf16_ok,expect", [
    ("fp16-mixed", "hot", True, "fp16-mixed,keep_fp32=hot"),
    ("fp16-mixed,keep_fp32=hot", "hot", True, "bf16-mixed,keep_fp32=hot"),
    ("fp16-mixed", None, True, "bf16-mixed"),
    ("fp16-mixed", None, False, "fp32"),
    ("fp16-pure", None, True, "bf16-pure"),
    ("bf16-mixed", "blocks.0.mlp", True, "bf16-mixed,keep_fp32=blocks.0.mlp"),
    ("bf16-mixed", "", True, "fp32"),          # the root module: keeping it is no smaller than fp32
    ("bf16-kahan", None, True, "fp32"),
    ("fp32", "hot", True, None),
    ("bf16-lean", None, True, "fp32"),                  # bf16 params and 8-bit state: both to fp32
    ("fp32,state=int8,state_rounding=stochastic", "hot", True, "fp32"),   # fp32 params: the 8-bit state goes
    ("fp32,state=fp8", None, True, "fp32"),
])
def test_next_policy_ladder(policy, module, bf16_ok, expect):
    new, why = next_policy(mixprec.Policy.parse(policy), module, bf16_ok=bf16_ok)
    assert (new, bool(why)) == ((None if expect is None else mixprec.Policy.parse(expect)), True)
