"""torch's `device=` (issue 35: a device DTM cannot serve fails loudly, at the first request,
naming what is missing, never falling back): the creation functions and `.to` take the CPU
in every spelling; "cuda" and "hip" raise E0801 at the user's line naming what this machine
lacks (the driver library, a driver that starts, a device, or DTM's own backend), each step
of the probe checked here with a stand-in driver, since these machines have no GPU."""

from __future__ import annotations

import ctypes

import pytest

import dtm
from dtm.backends import gpu_probe
from dtm.errors import DTMError, ErrorCode

CREATORS = {
    "tensor": lambda d: dtm.tensor([1.0, 2.0], device=d),
    "zeros": lambda d: dtm.zeros(2, 3, device=d),
    "ones": lambda d: dtm.ones(2, device=d),
    "full": lambda d: dtm.full((2,), 7.0, device=d),
    "arange": lambda d: dtm.arange(5, device=d),
    "randn": lambda d: dtm.randn(2, device=d),
    "rand": lambda d: dtm.rand(2, device=d),
    "randint": lambda d: dtm.randint(0, 9, (2,), device=d),
    "zeros_like": lambda d: dtm.zeros_like(dtm.ones(2), device=d),
    "ones_like": lambda d: dtm.ones_like(dtm.ones(2), device=d),
    "full_like": lambda d: dtm.full_like(dtm.ones(2), 3.0, device=d),
    "randn_like": lambda d: dtm.randn_like(dtm.ones(2), device=d),
    "rand_like": lambda d: dtm.rand_like(dtm.ones(2), device=d),
}


class _TorchDevice:  # what torch.device("cpu") looks like to DTM
    type = "cpu"


@pytest.mark.parametrize("name", sorted(CREATORS))
def test_every_creation_function_takes_the_cpu_and_refuses_a_gpu(name):
    for cpu in ("cpu", "cpu:0", _TorchDevice()):
        assert CREATORS[name](cpu).shape[0] == 2 or name == "arange"
    for gpu, names in (("cuda", "libcuda"), ("cuda:1", "libcuda"), ("hip", "libamdhip64")):
        with pytest.raises(DTMError) as e:
            CREATORS[name](gpu)
        assert e.value.code is ErrorCode.UNKNOWN_BACKEND and f"dtm.{name}" in e.value.message
        assert names in e.value.message or "driver" in e.value.message, e.value.message  # (a machine with one)
        assert "test_devices.py" in str(e.value)  # the user's line


def test_a_module_moved_to_a_gpu_names_what_is_missing():
    m = dtm.nn.Linear(2, 2)
    with pytest.raises(DTMError) as e:
        m.to("cuda")
    assert e.value.code is ErrorCode.UNKNOWN_BACKEND and "device 'cuda'" in e.value.message
    with pytest.raises(DTMError, match="device 'hip'"):
        m.to(device="hip")
    assert m.to("cpu") is m


class _Driver:
    """A stand-in driver library: init's and count's return codes, and the devices it sees."""

    def __init__(self, init_rc: int, count_rc: int, devices: int):
        self.init_rc, self.count_rc, self.devices = init_rc, count_rc, devices

    def __getattr__(self, name):
        if name.endswith("Init"):
            return lambda flags: self.init_rc

        def count(ref):
            ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = self.devices
            return self.count_rc
        return count


@pytest.mark.parametrize("kind, lib", [("cuda", "libcuda.so.1"), ("hip", "libamdhip64.so.6")])
def test_the_probe_names_the_first_missing_piece(kind, lib, monkeypatch):
    monkeypatch.setattr(gpu_probe.ctypes.util, "find_library", lambda name: None)
    assert "was not found" in gpu_probe.unavailable(kind)
    monkeypatch.setattr(gpu_probe.ctypes.util, "find_library", lambda name: lib)

    def broken(path):
        raise OSError(f"{path}: cannot open shared object file")
    monkeypatch.setattr(gpu_probe.ctypes, "CDLL", broken)
    assert "cannot be loaded" in gpu_probe.unavailable(kind) and lib in gpu_probe.unavailable(kind)
    for driver, says in ((_Driver(100, 0, 0), "did not start"), (_Driver(0, 0, 0), "sees no device"),
                         (_Driver(0, 0, 2), f"no {kind} backend yet")):
        monkeypatch.setattr(gpu_probe.ctypes, "CDLL", lambda path, d=driver: d)
        assert says in gpu_probe.unavailable(kind), gpu_probe.unavailable(kind)
    with pytest.raises(DTMError, match=f"no {kind} backend yet"):
        dtm.zeros(1, device=kind)
