"""What a new-user trial found in the bench, budget, checkpoint and policy messages (issues 27/28)."""

from __future__ import annotations

import pytest
import torch

from mixprec import Policy
from mixprec.policy.policy import PRESETS


@pytest.mark.parametrize("text", ["saved=fp32", "state=int8", " saved=compute , state=bf16"])
def test_a_policy_of_overrides_alone_is_refused_not_silently_fp32(text):
    with pytest.raises(ValueError, match=r"names no preset.*name a preset first, e.g. 'bf16-mixed,"):
        Policy.parse(text)


def test_a_policy_of_keys_that_set_the_precision_still_parses():
    assert Policy.parse("params=bf16,compute=bf16,master=fp32") == PRESETS["bf16-pure"]
    assert Policy.parse("compute=fp16").compute_dtype == torch.float16
    assert Policy.parse("fp32,state=int8").state_dtype == torch.int8     # a preset first: as before
    with pytest.raises(ValueError, match=r"rounding='up' is not allowed"):   # a bad value is named first
        Policy.parse("rounding=up")
