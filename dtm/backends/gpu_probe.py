"""What a machine lacks for a GPU device, in words (issue 35: a request for a device DTM
cannot serve fails loudly, naming the missing piece, and never falls back to the host or to
the other vendor). Each probe goes as far as the machine allows: the vendor's driver
library, then starting it, then a device; past that, what DTM itself lacks.

    reason = unavailable("cuda")   # "no NVIDIA driver: libcuda.so was not found ..."
"""

from __future__ import annotations

import ctypes
import ctypes.util

# (driver library, init call, device-count call, vendor, what installs the driver)
_DRIVERS = {
    "cuda": ("cuda", "cuInit", "cuDeviceGetCount", "NVIDIA", "the NVIDIA driver"),
    "hip": ("amdhip64", "hipInit", "hipGetDeviceCount", "ROCm", "ROCm (its HIP runtime)"),
}


def unavailable(kind: str) -> str:
    """Why device `kind` ("cuda" or "hip") cannot run DTM's tensors here."""
    name, init, count, vendor, install = _DRIVERS[kind]
    found = ctypes.util.find_library(name)
    if found is None:
        return (f"no {vendor} driver: lib{name}.so was not found on this machine's library path "
                f"(install {install}, or set LD_LIBRARY_PATH to where it is)")
    try:
        lib = ctypes.CDLL(found)
    except OSError as e:
        return f"the {vendor} driver library {found} cannot be loaded: {e}"
    rc = getattr(lib, init)(0)
    if rc != 0:
        return f"the {vendor} driver ({found}) did not start: {init} returned error {rc}"
    n = ctypes.c_int(0)
    rc = getattr(lib, count)(ctypes.byref(n))
    if rc != 0 or n.value < 1:
        return f"the {vendor} driver ({found}) sees no device ({count}: error {rc}, {n.value} devices)"
    return (f"the {vendor} driver sees {n.value} device(s), but this DTM has no {kind} backend yet: its "
            "kernels compile for the CPU only")


__all__ = ["unavailable"]
