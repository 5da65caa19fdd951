"""mixprec.autocast.switch: the per-thread on/off that portable ops and planned kernels share."""

import threading

from mixprec.autocast.switch import Switch


def test_turned_on_nests_installs_first_and_restores():
    installed = []
    switch = Switch(("cpu", "mps"), installed.append)
    assert switch.on() == () and not switch.is_on("cpu")
    with switch.turned_on("cpu"):
        assert installed == ["cpu"] and switch.on() == ("cpu",) and switch.is_on("cpu")
        with switch.turned_on("mps"), switch.turned_on("cuda"), switch.turned_on("cpu", enabled=False):
            assert switch.on() == ("cpu", "mps")   # cuda: not a device it can be on for; enabled=False: a no-op
        assert switch.on() == ("cpu",)
    assert switch.on() == () and installed == ["cpu", "mps"]


def test_exactly_sets_the_whole_set_and_leaves_out_other_devices():
    installed = []
    switch = Switch(("cpu",), installed.append)
    with switch.turned_on("cpu"):
        with switch.exactly(()):
            assert switch.on() == ()
        with switch.exactly(("cuda", "cpu")):
            assert switch.on() == ("cpu",)
        assert switch.on() == ("cpu",)
    assert installed == ["cpu", "cpu"]   # install is called each time; it returns at once when done


def test_the_switch_is_per_thread():
    switch = Switch(("cpu",), lambda device_type: None)
    seen = []
    with switch.turned_on("cpu"):
        thread = threading.Thread(target=lambda: seen.append(switch.on()))
        thread.start()
        thread.join()
    assert seen == [()]


def test_a_held_backward_pass_has_the_captured_switches_on_until_it_ends_in_any_thread():
    import torch

    from mixprec.autocast.switch import captured, hold_in_backward

    switch = Switch(("cpu",), lambda device_type: None)
    with switch.turned_on("cpu"):
        state = captured()
    assert (switch, ("cpu",)) in state
    seen = []

    class Probe(torch.autograd.Function):   # its backward asks the switch, as a recompute's kernels do
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(switch.is_on("cpu"))
            with switch.exactly(()):        # exactly() wins over a held pass (ops.checkpoint's restore)
                seen.append(switch.is_on("cpu"))
            return g * 2

    x = torch.ones(3, requires_grad=True)
    y = Probe.apply(x).sum()
    assert hold_in_backward(state, [y, y]) == 1   # one hook per grad_fn
    thread = threading.Thread(target=lambda: torch.autograd.grad(y, x, retain_graph=True))
    thread.start()
    thread.join()
    assert seen == [True, False]
    assert not switch.is_on("cpu") and switch.on() == ()   # off again here and after the pass
    Probe.apply(x).sum().backward()                         # an unheld pass: off
    assert seen == [True, False, False, False]


def test_a_traced_annotation_turns_the_switch_on_for_the_nodes_under_it():
    import torch.fx.traceback as fx_traceback

    from mixprec.autocast.switch import traced_annotation

    switch = Switch(("cpu",), lambda device_type: None)
    with fx_traceback.annotate(traced_annotation(((switch, ("cpu",)),))):
        assert switch.is_on("cpu") and switch.on() == ("cpu",)
        with switch.exactly(()):
            assert not switch.is_on("cpu")
    assert not switch.is_on("cpu")
