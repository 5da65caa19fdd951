import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec.policy.policy import BLOCK_RECIPE_NAMES, FP8_FORMATS, FP8_RECIPES, PRESETS, Policy

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_presets_table():
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    expected = {  # name: (params, compute, master, rounding, loss_scale, AdamW bytes/param)
        "fp32": (fp32, fp32, None, "nearest", "none", 16),
        "bf16-mixed": (fp32, bf16, None, "nearest", "none", 16),
        "fp16-mixed": (fp32, fp16, None, "nearest", "dynamic", 16),
        "bf16-pure": (bf16, bf16, fp32, "nearest", "none", 18),
        "fp16-pure": (fp16, fp16, fp32, "nearest", "dynamic", 18),
        "bf16-kahan": (bf16, bf16, None, "kahan", "none", 14),
        "bf16-sr": (bf16, bf16, None, "stochastic", "none", 12),
        "bf16-lean": (bf16, bf16, None, "stochastic", "none", 2 + 2 + 2 * (1 + 4 / 256)),   # 6.03125
    }
    for name, (params, compute, master, rounding, scale, nbytes) in expected.items():
        p = PRESETS[name]
        assert (p.param_dtype, p.compute_dtype, p.master_dtype, p.rounding, p.loss_scale) == \
               (params, compute, master, rounding, scale), name
        assert p.state_dtype == (torch.int8 if name == "bf16-lean" else fp32) and p.output_dtype == fp32
        assert p.state_rounding == "nearest" and p.quantized_state == (name == "bf16-lean")
        assert p.bytes_per_param() == nbytes, name
    assert set(expected) | {"fp8-mixed", "mxfp8-mixed", "nvfp4-mixed"} == set(PRESETS)   # a new preset gets a row here


def test_8bit_state_policies_parse_round_trip_and_count_their_bytes():
    """state=int8 / fp8 count 1 byte per element and moment plus one fp32 scale per 256 (4/256 bytes)."""
    lean = Policy.parse("bf16-sr,state=int8")
    assert lean == PRESETS["bf16-lean"] and str(lean) == "bf16-lean"
    kahan = Policy.parse("bf16-kahan,state=int8")
    assert (kahan.rounding, kahan.state_dtype, str(kahan)) == ("kahan", torch.int8, "bf16-kahan,state=int8")
    assert kahan.bytes_per_param() == 2 + 2 + 2 * (1 + 4 / 256) + 2 == 8.03125
    assert PRESETS["bf16-lean"].bytes_per_param(optimizer_states=1) == 5.015625   # SGD with momentum
    assert Policy.parse("bf16-pure,state=int8").bytes_per_param() == 2 + 4 + 4 + 2.03125
    fp8 = Policy.parse("bf16-mixed,state=fp8")
    assert fp8.state_dtype == torch.float8_e4m3fn and fp8.bytes_per_param() == 4 + 4 + 2.03125
    sr = Policy.parse("bf16-lean,state_rounding=stochastic")
    assert sr.state_rounding == "stochastic" and str(sr) == "bf16-lean,state_rounding=stochastic"
    for policy in (lean, kahan, fp8, sr, Policy.parse("fp32,state=int8"), Policy.parse("fp32,state=fp8,state_rounding=stochastic")):
        assert Policy.parse(str(policy)) == policy
    assert str(Policy.parse("bf16-lean,state=fp32")) == "bf16-sr"


def test_parse_preset_with_overrides():
    p = Policy.parse("bf16-kahan,state=bf16")
    assert p.rounding == "kahan" and p.state_dtype == torch.bfloat16 and p.param_dtype == torch.bfloat16
    assert p.bytes_per_param() == 10
    assert Policy.parse("params=bf16,compute=bf16,master=fp32") == PRESETS["bf16-pure"]
    assert str(Policy.parse("params=bf16,compute=bf16,master=fp32")) == "bf16-pure"
    assert Policy.parse("fp8-mixed,recipe=delayed").fp8 == "delayed"
    assert Policy.parse("fp8-mixed,fp8_format=e4m3").fp8_format == "e4m3"
    assert Policy.parse("fp8-mixed,fp8_ends=fp8").fp8_keep_ends is False
    assert str(Policy.parse("fp8-mixed,fp8_ends=keep")) == "fp8-mixed"
    assert Policy.parse("bf16-mixed,keep_fp32=head|blocks.*.ln*").keep_fp32 == ("head", "blocks.*.ln*")
    assert Policy.parse("fp16-mixed,loss_scale=1024").loss_scale == 1024.0


@pytest.mark.parametrize("text,match", [
    ("bf17-mixed", r"preset 'bf17-mixed' is not known \(did you mean 'bf16-mixed'\?\); choose one of .*bf16-mixed"),
    ("bf16_lean", r"preset 'bf16_lean' is not known \(did you mean 'bf16-lean'\?\)"),
    ("qwerty", r"preset 'qwerty' is not known; choose one of"),          # nothing close: no guess
    ("bf16", r"preset 'bf16' is not known \(did you mean 'bf16-mixed'\?\)"),   # a bare dtype: its -mixed preset
    ("fp16", r"preset 'fp16' is not known \(did you mean 'fp16-mixed'\?\)"),
    ("fp8", r"preset 'fp8' is not known \(did you mean 'fp8-mixed'\?\)"),
    ("mxfp8", r"preset 'mxfp8' is not known \(did you mean 'mxfp8-mixed'\?\)"),
    ("nvfp4", r"preset 'nvfp4' is not known \(did you mean 'nvfp4-mixed'\?\)"),
    ("bf16-mixed,colour=red", r"key 'colour' .* is not known; choose from .*compute"),
    ("bf16-lean,stat=int8", r"key 'stat' .* is not known \(did you mean 'state'\?\)"),
    ("bf16-lean,state_roundin=stochastic", r"key 'state_roundin' .* \(did you mean 'state_rounding'\?\)"),
    ("params=bf61", r"params='bf61' is not allowed \(did you mean 'bf16'\?\)"),
    ("params=int8", r"params='int8' is not allowed; choose one of \['fp32', 'bf16', 'fp16'\]"),
    ("rounding=up", r"rounding='up' is not allowed"),
    ("fp16-pure,rounding=stochastic", r"replaces master weights"),
    ("params=fp16,compute=fp16,rounding=stochastic", r"bf16 params only"),
    ("fp32,master=fp32", r"redundant"),
    ("params=bf16,compute=fp16", r"16-bit params must compute in their own dtype"),
    ("fp16-mixed,loss_scale=-4", r"finite number > 0"),
    ("fp16-mixed,loss_scale=lots", r"'dynamic', 'none' or a number"),
    ("fp16-mixed,loss_scale=1e-50", r"normal fp32 value"),
    ("bf16-mixed,state=bf16,state=fp32", r"sets state_dtype twice"),
    ("bf16-lean,state=int4", r"state='int4' is not allowed; choose one of \['fp32', 'bf16', 'fp16', 'int8', 'fp8'\]"),
    ("bf16-lean,state_rounding=up", r"state_rounding='up' is not allowed; choose one of \('nearest', 'stochastic'\)"),
    ("bf16-sr,state_rounding=stochastic", r"rounds bf16 or 8-bit optimizer state, but state=fp32; set state=bf16"),
    ("bf16-mixed,fp8=blockwise", r"fp8='blockwise' is not allowed"),
    ("bf16-mixed,fp8_format=e4m3", r"needs fp8 linears"),
    ("bf16-mixed,fp8_ends=fp8", r"needs fp8 linears"),
    ("fp8-mixed,fp8_ends=maybe", r"fp8_ends='maybe' is not allowed"),
    ("fp8-mixed,fp8_format=e3m4", r"fp8_format='e3m4' is not allowed"),
    ("fp32,fp8=tensorwise", r"compute=fp32"),
    ("auto", r"resolve it with mixprec.resolve_policy"),
    ("", r"is empty"),
    ("bf16-mixed,fp32", r"preset name may only come first"),
])
def test_parse_errors_name_the_bad_part(text, match):
    with pytest.raises(ValueError, match=match):
        Policy.parse(text)


def test_frozen_and_replace():
    p = PRESETS["bf16-mixed"]
    with pytest.raises(AttributeError):
        p.compute_dtype = torch.float16
    q = p.replace(keep_fp32=("head",))
    assert q.keep_fp32 == ("head",) and p.keep_fp32 == ()
    with pytest.raises(TypeError, match="tuple of non-empty"):
        p.replace(keep_fp32="head")


@st.composite
def policies(draw):
    params = draw(st.sampled_from(DTYPES))
    half = params != torch.float32
    rounding = draw(st.sampled_from(["nearest", "kahan"] + (["stochastic"] if params == torch.bfloat16 else []))) \
        if half else "nearest"
    master = draw(st.sampled_from([None, torch.float32])) if half and rounding == "nearest" else None
    scale = draw(st.one_of(st.sampled_from(["dynamic", "none"]),
                           st.floats(min_value=1e-3, max_value=1e9, allow_nan=False)))
    keep = tuple(draw(st.lists(st.from_regex(r"[a-z][a-z0-9_.*]{0,8}", fullmatch=True), max_size=3)))
    compute = params if half else draw(st.sampled_from(DTYPES))
    fp8 = draw(st.sampled_from((None,) + FP8_RECIPES)) if compute != torch.float32 else None
    fp8_format = draw(st.sampled_from(FP8_FORMATS)) if fp8 else "hybrid"
    keep_ends = draw(st.booleans()) if fp8 else True
    block = draw(st.sampled_from((None,) + BLOCK_RECIPE_NAMES)) if compute == torch.bfloat16 and not fp8 else None
    state = draw(st.sampled_from(DTYPES + [torch.int8, torch.float8_e4m3fn]))
    state_rounding = draw(st.sampled_from(["nearest", "stochastic"])) if state in (torch.int8, torch.float8_e4m3fn) \
        else "nearest"
    return Policy(param_dtype=params, compute_dtype=compute,
                  output_dtype=draw(st.sampled_from(DTYPES)), master_dtype=master, rounding=rounding,
                  state_dtype=state, state_rounding=state_rounding, loss_scale=scale, keep_fp32=keep,
                  fp8=fp8, fp8_format=fp8_format, fp8_keep_ends=keep_ends, block=block)


@settings(max_examples=300, deadline=None)
@given(policies())
def test_text_round_trip(policy):
    assert Policy.parse(str(policy)) == policy


@pytest.mark.parametrize("written", [
    "fp16-mixed", "fp16-pure", "compute=fp16", "params=fp16,compute=fp16,master=fp32", "bf16-mixed,compute=fp16",
    "fp32,compute=fp16,keep_fp32=0"])
def test_every_way_of_writing_an_fp16_policy_scales_the_loss(written):
    policy = Policy.parse(written)
    assert policy.loss_scale == "dynamic" and policy.scaling_note() == ""
    assert Policy.parse(str(policy)) == policy


def test_fp16_policies_built_in_python_scale_and_explicit_none_is_recorded():
    assert Policy(compute_dtype=torch.float16).loss_scale == "dynamic"
    assert Policy(param_dtype=torch.float16, compute_dtype=torch.float16, master_dtype=torch.float32).loss_scale == "dynamic"
    assert Policy.parse("fp32").replace(compute_dtype=torch.float16).loss_scale == "dynamic"
    assert Policy().loss_scale == "none" and Policy(compute_dtype=torch.bfloat16).loss_scale == "none"
    unscaled = Policy.parse("fp16-mixed,loss_scale=none")
    assert unscaled.loss_scale == "none" and "fp16 without loss scaling" in unscaled.scaling_note()
    from mixprec import MixedPrecision
    model = torch.nn.Linear(4, 1)
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=unscaled, device="cpu")
    assert "fp16 without loss scaling (loss_scale=none, as written)" in mp.decision


def test_small_gradients_survive_under_a_key_written_fp16_policy():
    """A loss of ~1e-9 x output: its fp16 gradients (~1e-9) are below fp16's smallest subnormal (6e-8)
    unscaled; with the default dynamic scale (2**16) they survive (~6.6e-5, a normal fp16 number)."""
    from mixprec import MixedPrecision
    grads = {}
    for written in ("compute=fp16", "compute=fp16,loss_scale=none"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=written, device="cpu")
        with mp.autocast():
            loss = mp.model(torch.randn(4, 8)).float().sum() * 1e-9
        mp.backward(loss)
        grads[written] = model[0].weight.grad.clone() / float(mp.loss_scale.scale)
        mp.step()
    assert (grads["compute=fp16"] != 0).float().mean() > 0.9
    assert (grads["compute=fp16,loss_scale=none"] == 0).all()


def test_auto_with_overrides_names_the_resolve_then_override_recipe():
    with pytest.raises(ValueError, match=r"'auto' takes no overrides; resolve it first, then add them: .*"
                                         r"resolve_policy\('auto', device.*\+ ',kernels=native,state=int8'"):
        Policy.parse("auto,kernels=native,state=int8")
    with pytest.raises(ValueError, match=r"policy 'auto' depends on the device"):
        Policy.parse("auto")
    resolved = Policy.parse("bf16-mixed")                       # the recipe itself works
    assert Policy.parse(str(resolved) + ",kernels=native,state=int8") == Policy.parse("bf16-mixed,kernels=native,state=int8")
