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
