"""torch.compile of a function that enters ``mp.autocast()`` (mixprec.engine.autocast_scope): one graph.

Before, dynamo broke the graph at the context manager (2 graphs); ``torch.autocast`` itself traces. The traced
``mp.autocast()`` must also keep eager's dtypes and kernels: ops=portable (layer_norm, softmax in fp32, as
CUDA's lists) and kernels=measured (the planned attention kernel), the bf16-mixed defaults. ``aot_eager`` runs
the traced aten ops with torch's eager kernels, so its output equals eager bit for bit. Inductor fuses pointwise
ops and keeps fp32 intermediates where eager rounds each op's output to bf16: each such rounding is at most half a
bf16 ulp (2^-9 relative), so on these few ops the output stays within 4 bf16 ulps of its magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.ln, self.qkv, self.head = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 24), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.inp(x))
        q, k, v = self.qkv(h).view(2, 4, 2, 12).transpose(1, 2).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 4, 8)
        return self.head(h + a).softmax(-1)


def _engine(policy: str = "bf16-mixed") -> MixedPrecision:
    model = _Net()
    return MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, device="cpu")


def _x() -> torch.Tensor:
    return torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(2))


def _step(mp: MixedPrecision):
    def step(x: torch.Tensor) -> torch.Tensor:
        with mp.autocast():
            out = mp.model(x)
        return out
    return step


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp32"])
def test_a_function_entering_mp_autocast_compiles_to_one_graph(policy):
    """fullgraph=True raises at any graph break (``torch._dynamo.explain`` is no judge here: a frame dynamo gives
    up on runs eagerly and its callees compile alone, which it counts as one graph); the one graph holds the
    autocast region and the model's ops."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    mp = _engine(policy)
    torch.compile(_step(mp), backend=counter, fullgraph=True)(_x())
    assert counter.frame_count == 1 and len(counter.graphs) == 1
    targets = [str(getattr(n.target, "__name__", n.target)) for n in counter.graphs[0].graph.nodes]
    assert targets.count("_enter_autocast") == targets.count("_exit_autocast") == 1
    assert "linear" in targets and "layer_norm" in targets and "scaled_dot_product_attention" in targets, targets


def test_compiled_mp_autocast_with_aot_eager_equals_eager_bit_for_bit():
    mp = _engine()
    assert mp.policy.ops == "portable" and mp.policy.kernels == "measured"
    step = _step(mp)
    eager = step(_x())
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(_x())
    assert compiled.dtype == eager.dtype == torch.float32   # softmax: CUDA's fp32 list
    assert torch.equal(compiled, eager)


def test_compiled_mp_autocast_keeps_the_portable_dtypes_inside():
    """The dtypes inside the traced block are eager's: layer_norm's output fp32 (portable), the linear's bf16."""
    mp = _engine()

    def inner(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with mp.autocast():
            h = mp.module.ln(mp.module.inp(x))
            return h, mp.module.qkv(h)

    eager = inner(_x())
    compiled = torch.compile(inner, backend="aot_eager", fullgraph=True)(_x())
    assert [t.dtype for t in eager] == [t.dtype for t in compiled] == [torch.float32, torch.bfloat16]
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def test_compiled_mp_autocast_with_inductor_is_within_the_bf16_bound():
    mp = _engine()
    step = _step(mp)
    eager = step(_x())
    compiled = torch.compile(step, fullgraph=True)(_x())
    ulp = torch.finfo(torch.bfloat16).eps   # 2^-7: one bf16 ulp at 1.0 (softmax outputs are at most 1)
    assert compiled.dtype == eager.dtype and float((compiled - eager).detach().abs().max()) <= 4 * ulp


def test_a_compiled_training_step_with_aot_eager_trains_as_eager_bit_for_bit():
    """The loss computed in the compiled function, ``mp.backward`` and ``mp.step`` after it: three steps give
    the eager loop's weights (the compiled backward runs after the block, with autocast off, as eager's)."""
    target = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(4)).softmax(-1)
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        mp = _engine()

        def loss_fn(x: torch.Tensor) -> torch.Tensor:
            with mp.autocast():
                return (mp.model(x) - target).square().mean()

        fn = torch.compile(loss_fn, backend="aot_eager", fullgraph=True) if compiled else loss_fn
        for _ in range(3):
            mp.backward(fn(_x()))
            assert mp.step().applied
        runs.append([p.detach().clone() for p in mp.module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_under_fp16_mp_autocast_breaks_the_graph_so_inductor_emulates_eagers_fp16_roundings():
    """fp16 keeps the eager path (a graph break at mp.autocast()): the body then compiles inside it, under
    ``eager_dtypes``' inductor option ``emulate_precision_casts`` (fused kernels overflow where eager does),
    which a traced block could not set; the output is eager's."""
    import torch._inductor.config as inductor_config

    seen = []

    def backend(gm, example_inputs):
        seen.append(inductor_config.emulate_precision_casts)
        return gm.forward

    mp = _engine("fp16-mixed")
    step = _step(mp)
    eager = step(_x())
    assert torch.equal(torch.compile(step, backend=backend)(_x()), eager)
    assert seen and all(seen)
