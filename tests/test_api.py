"""The public API is exactly the reviewed list: nothing private leaks, nothing is listed twice,
and every listed name imports and says what it is."""

import inspect

import pytest

import mixprec

REVIEWED = [
    "CheckpointError", "DivergenceError", "DynamicLossScale", "EMA", "Format", "Guard", "MixedPrecision", "NoLossScale",
    "NumericsReport", "PRESETS", "Policy", "Recommendation", "StaticLossScale", "StepResult", "fp8", "get_format",
    "inspect", "load_checkpoint", "locate_nonfinite", "ops", "optim", "probe", "resolve_policy", "save_checkpoint",
]


def test_all_equals_the_reviewed_sorted_list():
    assert REVIEWED == sorted(REVIEWED)
    assert sorted(mixprec.__all__) == REVIEWED
    assert len(set(mixprec.__all__)) == len(mixprec.__all__)


# data, not code: a dict's or a float's docstring is its type's, so these are checked by type instead
DATA = {"PRESETS": dict, "AMAX_FLOOR": float}


def _check_documented(module, name):
    namespace = {}
    exec(f"from {module.__name__} import {name}", namespace)   # what a user writes
    obj = namespace[name]
    assert obj is getattr(module, name)
    if name in DATA:
        assert isinstance(obj, DATA[name]), name
    else:
        assert inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj), name
        assert obj.__doc__ and obj.__doc__.strip(), f"{module.__name__}.{name} has no docstring"


@pytest.mark.parametrize("name", REVIEWED)
def test_every_public_name_imports_and_has_a_docstring(name):
    _check_documented(mixprec, name)


def test_submodules_have_small_explicit_documented_apis():
    assert mixprec.optim.__all__ == ["AdamW", "SGD", "adopt_sr_seed"]
    assert all(not n.startswith("_") for n in mixprec.ops.__all__)
    for module in (mixprec.fp8, mixprec.ops, mixprec.optim):
        assert len(set(module.__all__)) == len(module.__all__)
        for name in module.__all__:
            _check_documented(module, name)
