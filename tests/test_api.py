"""The public API is exactly the reviewed list: nothing private leaks, nothing is listed twice."""

import mixprec

REVIEWED = [
    "CheckpointError", "DivergenceError", "DynamicLossScale", "Format", "Guard", "MixedPrecision", "NoLossScale", "NumericsReport",
    "PRESETS", "Policy", "Recommendation", "StaticLossScale", "StepResult", "fp8", "get_format", "inspect",
    "load_checkpoint", "locate_nonfinite", "ops", "optim", "probe", "resolve_policy", "save_checkpoint",
]


def test_all_equals_reviewed_list():
    assert sorted(mixprec.__all__) == sorted(REVIEWED)
    assert len(set(mixprec.__all__)) == len(mixprec.__all__)
    assert not [name for name in mixprec.__all__ if name.startswith("_")]
    for name in mixprec.__all__:
        assert getattr(mixprec, name) is not None


def test_submodules_have_small_explicit_apis():
    assert mixprec.optim.__all__ == ["AdamW", "SGD"]
    assert all(not n.startswith("_") for n in mixprec.ops.__all__)
