"""locate_nonfinite: the first module whose output goes non-finite (case 11), the batch, the loss,
the backward; and no trace left behind (hooks, buffers, RNG)."""

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision

from mixprec import locate_nonfinite
from mixprec.numerics import NonFiniteReport


class Overflowing(nn.Module):
    """Case 11: input 1x64 of 40 into a Linear 64->8 of weight 30: each output is 76800 > 65504."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.big = nn.Linear(64, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 1)
        with torch.no_grad():
            self.inp.weight.copy_(torch.eye(64))
            self.inp.bias.zero_()
            self.big.weight.fill_(30.0)

    def forward(self, x):
        return self.out(self.norm(self.big(self.inp(x))))


def mse(model, x):
    return model(x).float().pow(2).mean()


def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


X40 = torch.full((1, 64), 40.0)


def test_names_the_planted_overflowing_layer_with_dtype_and_amax():
    model = Overflowing()
    report = locate_nonfinite(model, X40, mse, "fp16-mixed")
    assert isinstance(report, NonFiniteReport)
    assert (report.where, report.module, report.module_type) == ("forward", "big", "Linear")
    assert report.dtype == torch.float16
    assert report.input_amax == 40.0 and report.output_amax == float("inf") and report.kind == "inf"
    assert report.output_amax_fp32 == 76800.0 and not report.loss_finite
    assert str(report) == ("'big' (Linear) produced inf in fp16 from finite inputs (input amax 40, output amax inf); "
                           "in fp32 its output amax is 76800, above fp16's max 65504: an overflow")
    assert hook_count(model) == 0


@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed"])
def test_healthy_model_gives_none_and_leaves_no_hooks(policy):
    model = Overflowing()     # in bf16 (fp32's exponent range) the same block stays finite
    assert locate_nonfinite(model, X40, mse, policy) is None
    assert hook_count(model) == 0
    small = torch.randn(4, 64)
    assert locate_nonfinite(model, small, mse, "fp16-mixed") is None


def test_keep_fp32_region_of_a_prepared_model_is_respected_and_its_hooks_stay():
    model = Overflowing()
    mp = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="fp16-mixed,keep_fp32=big",
                        device="cpu")
    engine_hooks = hook_count(model)
    assert locate_nonfinite(mp.model, X40, mse, mp.policy) is None
    assert hook_count(model) == engine_hooks > 0


def test_nan_in_the_batch_names_its_first_reader():
    x = X40.clone()
    x[0, 7] = float("nan")
    report = locate_nonfinite(Overflowing(), x, mse, "fp32")
    assert (report.where, report.module, report.kind) == ("input", "inp", "nan")
    assert str(report) == "the batch itself holds nan (first read by 'inp' (Linear)): fix the data; precision cannot"


def test_non_finite_loss_from_a_finite_forward_blames_the_loss():
    report = locate_nonfinite(Overflowing(), torch.randn(2, 64), lambda m, x: m(x).sum().log() * 0 + float("inf"),
                              "fp32")
    assert (report.where, report.module, report.kind) == ("loss", None, "inf")


def test_backward_overflow_names_the_module_and_the_gradient():
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
            with torch.no_grad():
                self.b.weight.fill_(6e4)
                self.a.bias.zero_()
                self.b.bias.zero_()

        def forward(self, x):
            return self.c(self.b(self.a(x)) / 1e4)

    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(2, 4) * 0.01
    def total(m, x):
        return m(x).float().sum()

    report = locate_nonfinite(model, x, total, "fp16-mixed", loss_scale=2.0 ** 15)
    # the forward is finite; c's bias gradient (sum over the batch of 2 * 32768 = 65536) overflows fp16
    assert (report.where, report.module, report.dtype, report.loss_finite) == ("backward", "c", torch.float16, True)
    assert "the gradient of its parameter 'bias'" in report.tensor
    assert all(p.grad is None for p in model.parameters())          # nothing written to .grad
    assert locate_nonfinite(model, x, total, "fp16-mixed", loss_scale=1.0) is None


def test_leaves_no_trace_even_when_the_loss_raises():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    stats = [b.clone() for b in model.buffers()]
    x = torch.randn(8, 4) * 100
    rng = torch.get_rng_state()
    locate_nonfinite(model, x, lambda m, x: m(x).sum(), "bf16-mixed")
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers()))   # BatchNorm statistics restored
    assert torch.equal(torch.get_rng_state(), rng)                           # dropout did not move the RNG

    def broken(m, x):
        m(x)
        raise KeyError("boom")
    with pytest.raises(KeyError, match="boom"):
        locate_nonfinite(model, torch.randn(8, 4), broken, "fp32")
    assert hook_count(model) == 0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"loss_scale=0 is not allowed; it must be a finite number > 0"):
        locate_nonfinite(Overflowing(), X40, mse, "fp16-mixed", loss_scale=0)
    with pytest.raises(ValueError, match=r"preset 'fp17' is not known"):
        locate_nonfinite(Overflowing(), X40, mse, "fp17")
