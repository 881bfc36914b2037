"""DLPack in and out of DTM tensors, bfloat16 included.

numpy carries the exchange (a DTM tensor's value is a numpy array on the CPU), but numpy's
DLPack knows no bfloat16. A bfloat16 array therefore travels as its uint16 bits: on the way
out, numpy exports the bits and the capsule's dtype is relabelled bfloat16 before anyone
consumes it; on the way in, a producer's bfloat16 capsule is relabelled uint16 for numpy and
the array viewed as bfloat16. Relabelling changes no byte of the data and no owner: the
capsule's deleter stays the producer's.

The relabelled field is DLTensor.dtype.code, at a fixed offset in both capsule layouts
(DLPack 0.x `dltensor`: a DLManagedTensor; 1.x `dltensor_versioned`: a
DLManagedTensorVersioned, whose DLTensor follows a version, two pointers and flags).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..errors import ErrorCode, user_error as error
from ..ir.dtypes import DTYPES, numpy_dtype

K_DL_UINT, K_DL_BFLOAT = 1, 4  # DLDataTypeCode values
_DTYPE_OFFSET = 20  # DLTensor: void *data (8), DLDevice device (8), int32 ndim (4), then DLDataType dtype
_TENSOR_OFFSET = {b"dltensor": 0, b"dltensor_versioned": 32}  # where the DLTensor starts in each struct


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype, _get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype, _get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def _dtype(capsule: Any) -> _DLDataType:
    """The capsule's DLTensor dtype, in place (writable)."""
    name = _get_name(capsule)
    if name not in _TENSOR_OFFSET:  # "used_dltensor": already consumed
        raise error(ErrorCode.DTYPE_MISMATCH, f"expected an unconsumed DLPack capsule, found one named {name!r}")
    return _DLDataType.from_address(_get_pointer(capsule, name) + _TENSOR_OFFSET[name] + _DTYPE_OFFSET)


def export(array: np.ndarray, *args: Any, **kwargs: Any) -> Any:
    """array.__dlpack__(...), for a bfloat16 array too."""
    if array.dtype.name != "bfloat16":  # (by name: ml_dtypes loads only when a narrow type is used)
        return array.__dlpack__(*args, **kwargs)
    capsule = array.view(np.uint16).__dlpack__(*args, **kwargs)
    _dtype(capsule).code = K_DL_BFLOAT
    return capsule


class _Bits:
    """A producer as numpy sees it: a bfloat16 capsule relabelled as its uint16 bits
    (`relabelled` says whether it was), any other passed on as it is."""

    def __init__(self, producer: Any):
        self.producer, self.relabelled = producer, False

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        capsule = self.producer.__dlpack__(*args, **kwargs)
        dtype = _dtype(capsule)
        if (dtype.code, dtype.bits) == (K_DL_BFLOAT, 16):
            dtype.code, self.relabelled = K_DL_UINT, True
        return capsule

    def __dlpack_device__(self) -> Any:
        return self.producer.__dlpack_device__()


def to_numpy(obj: Any) -> np.ndarray:
    """np.from_dlpack(obj), for a bfloat16 producer too (a torch.bfloat16 tensor, a DTM one)."""
    producer = _Bits(obj)
    try:
        a = np.from_dlpack(producer)
    except (BufferError, TypeError, RuntimeError) as e:  # numpy's words for a dtype or device it cannot take
        raise error(ErrorCode.UNKNOWN_DTYPE, f"from_dlpack: cannot take this {type(obj).__name__} "
                                             f"({getattr(obj, 'dtype', '?')}): {e}") from None
    return a.view(numpy_dtype(DTYPES["bf16"])) if producer.relabelled else a
