"""Devices as torch names them: `device=` arguments and `.to(device)`. DTM's tensors live in
host memory (the backend, `DTM_BACKEND`, picks where kernels run), so "cpu" is accepted
wherever torch takes a device, and any other device is a DTMError at the user's line naming
what this machine lacks for it (dtm/backends/gpu_probe.py): never a silent fall-back."""

from __future__ import annotations

from typing import Any

from ..backends.gpu_probe import unavailable
from ..errors import ErrorCode, user_error as error

# torch's device types: a string that starts with one names a device, not a dtype
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "hip", "meta", "xla", "npu", "hpu", "ipu", "mtia", "vulkan")


def device_type(device: Any) -> str | None:
    """The device type `device` names ("cpu" for "cpu", "cpu:0" or a torch.device("cpu")),
    or None when it names none (a dtype, a tensor)."""
    if isinstance(device, str):
        kind = device.partition(":")[0]
        return kind if kind in DEVICE_TYPES else None
    kind = getattr(device, "type", None)  # torch.device and the like; Tensor.type is a method
    return kind if isinstance(kind, str) else None


def check_device(device: Any, what: str) -> None:
    """Accept a CPU device ("cpu", "cpu:0", an object whose .type is "cpu"); any other is a
    DTMError (E0801) naming it and, for a GPU, what this machine lacks for it."""
    kind = device_type(device)
    if kind == "cpu":
        return
    why = f": {unavailable(kind)}" if kind in ("cuda", "hip") else " is not available"
    raise error(ErrorCode.UNKNOWN_BACKEND, f"{what}: device {str(device)!r}{why}; DTM tensors live on the CPU "
                "(device 'cpu'), and DTM_BACKEND chooses how their kernels run")


__all__ = ["DEVICE_TYPES", "device_type", "check_device"]
