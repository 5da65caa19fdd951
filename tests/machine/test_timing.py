"""mixprec.machine.timing: one sync and one timer (what the bench, the op plan, auto, the probe and the doctor
time through)."""

import torch

from mixprec.machine.timing import synchronize, time_call, time_calls, timed


class Clock:
    def __init__(self):
        self.now = 0.0
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return self.now


def test_the_timer_reads_the_clock_around_the_call_only():
    clock, calls = Clock(), []

    def call():
        calls.append(clock.reads)   # the clock was read once before the call
        clock.now += 0.25
        return "out"

    assert timed(call, "cpu", clock=clock) == ("out", 0.25)
    assert calls == [1] and clock.reads == 2
    assert time_call(call, torch.device("cpu"), clock=clock) == 0.25
    assert time_calls(call, "cpu", 3, clock=clock) == [0.25] * 3
    assert len(calls) == 5


def test_synchronize_is_a_no_op_on_the_cpu_and_waits_on_cuda():
    synchronize("cpu")
    synchronize(torch.device("cpu"))
    if torch.cuda.is_available():
        x = torch.randn(256, 256, device="cuda")
        _ = x @ x
        synchronize("cuda")
        assert torch.cuda.current_stream().query()
