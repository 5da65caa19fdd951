"""mixprec.memory.live: peak live tensor bytes of a step, validated against a tensor census."""

import pytest
import torch
from torch import nn

from mixprec.memory.live import PeakLive, peak_live_bytes, resident_tensors, running_peak
from mixprec.memory.storages import StorageCounter


def test_cpu_peak_of_a_chain_of_known_allocations_is_exact():
    def step():
        a = torch.ones(1000)                             # 4000 B live
        b = torch.ones(500, dtype=torch.float64)         # 8000
        del a                                            # 4000
        c = torch.ones(3000, dtype=torch.bfloat16)       # 10000: the peak
        del b, c                                         # 0
        d = torch.ones(3, dtype=torch.uint8)             # 3: requested bytes, no allocator rounding
        return d

    out, live = peak_live_bytes(step, "cpu")
    assert live == PeakLive(bytes=10000, baseline=0, source=live.source) and "profiler" in live.source
    assert out.nbytes == 3


def test_cpu_peak_of_a_training_step_matches_its_census_and_the_baseline_counts_storages_once():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64, 32))
    x = torch.randn(16, 32)
    opt = torch.optim.SGD([w], lr=0.1)

    def step():
        y = torch.relu(x @ w.t())      # mm output (16x64 fp32) freed once relu's result exists
        loss = y.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    _, live = peak_live_bytes(step, "cpu", resident=[w, w, w[:3], x])   # w and its view once
    # census at the peak (MmBackward's output): y 16x64x4 + loss 4 + the backward's seed 4 + relu's
    # gradient 16x64x4 + the weight's gradient 64x32x4
    assert live.bytes == 16 * 64 * 4 + 4 + 4 + 16 * 64 * 4 + 64 * 32 * 4
    assert live.baseline == 64 * 32 * 4 + 16 * 32 * 4
    assert live.total == live.baseline + live.bytes


def test_running_peak_interleaves_threads_by_time_and_measures_above_the_start():
    # a free of something allocated before the window lowers the level below the start: peak stays >= 0
    assert running_peak([[(1, -50), (3, 100)], [(2, 30)]]) == 80
    assert running_peak([[(1, -10)]]) == 0


def test_running_peak_keeps_a_threads_recorded_order_when_the_clock_steps_back():
    # The profiler stamps events with CLOCK_REALTIME; an NTP step mid-window stamps the free of the 100 bytes
    # before their allocation. Recorded order: +100 (peak 100), -100, +50. Sorted by stamp it read 50.
    assert running_peak([[(5.0, 100), (1.0, -100), (6.0, 50)]]) == 100
    # another thread's events still fall in by time: 7 bytes before the step, alive at the peak
    assert running_peak([[(5.0, 100), (1.0, -100), (6.0, 50)], [(0.5, 7)]]) == 107


def test_resident_tensors_census_of_model_and_optimizer():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    counter = StorageCounter()
    total = sum(counter.add(t) for t in resident_tensors(model, opt))
    n = sum(p.numel() for p in model.parameters())
    buffers = sum(b.nbytes for b in model.buffers())
    steps = sum(s["step"].nbytes for s in opt.state.values())
    assert total == 4 * n * 4 + buffers + steps      # params, grads, exp_avg, exp_avg_sq (fp32) + buffers


def test_unknown_device_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="device='xla'.*cpu, cuda, mps"):
        peak_live_bytes(lambda: None, "xla")


@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed"])
def test_gpt_tiny_step_peak_holds_its_saved_activations_and_its_state(policy):
    from mixprec.programs.bench.measure import state_bytes
    from mixprec.programs.bench.step_memory import measure_step_memory
    from mixprec.programs.session import build_engine, train_step
    from mixprec.workloads import get_workload

    workload = get_workload("gpt", config="tiny")
    mp = build_engine(workload, policy, steps=4, seed=0, device="cpu")
    batches = workload.batches("train", 0)
    state = {}
    train_step(mp, workload, next(batches))
    train_step(mp, workload, next(batches), after_backward=lambda: state.update(s=state_bytes(mp.model, mp.optimizer)))
    memory = measure_step_memory(mp, workload, next(batches))
    s = state["s"]
    assert memory.saved.total > 0 and memory.live.bytes > 0
    # at the start of the backward every saved tensor and the whole state but the (set-to-None) gradients is live;
    # after the backward the whole state is
    buffers = StorageCounter(list(mp.model.parameters()))
    buffer_bytes = sum(buffers.add(b) for b in mp.model.buffers())
    assert memory.live.baseline == s.total - s.grads + s.scalars + buffer_bytes
    assert memory.live.total >= memory.live.baseline + memory.saved.total
    assert memory.live.total >= s.total


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_of_a_chain_counts_the_caching_allocators_512_byte_blocks():
    torch.ones(1, device="cuda")   # the context and a first segment exist before the window

    def step():
        a = torch.ones(1000, device="cuda")                          # 4000 B: a 4096-byte block
        b = torch.ones(500, dtype=torch.float64, device="cuda")      # 4096
        del a
        c = torch.ones(3000, dtype=torch.bfloat16, device="cuda")    # 6000 B: 6144, with b the peak
        del b, c

    _, live = peak_live_bytes(step, "cuda")
    assert live.bytes == 4096 + 6144 and live.baseline == torch.cuda.memory_allocated()
