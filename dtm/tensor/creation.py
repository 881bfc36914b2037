"""Making tensors: from data (lists, numpy, torch), filled (zeros, ones, full, arange) and
random (randn, rand: the IR's counter-based `random` op, so every backend draws the same
numbers for the same seed). Each takes torch's `device=`: "cpu", or a clear error naming
what this machine lacks for another device (devices.py)."""

from __future__ import annotations

import math
import operator
import os
from typing import Any, Sequence

import numpy as np

from ..errors import ErrorCode, user_error as error
from ..ir import DType
from ..ir.dtypes import numpy_dtype
from ..ir.dtypes import from_numpy as dtype_of_numpy
from ..ir.types import TensorType
from ..runtime.host import check_free
from . import dlpack
from .devices import check_device
from .core import STATE, Tensor, apply, no_grad, on_replay, result_type
from .dtypes import DEFAULT_FLOAT, as_dtype, bfloat16, check_fits, convert_scalar, int64


def _check_numbers(arr: np.ndarray, dtype: DType) -> None:
    """Python numbers given for an integer dtype must fit it, as torch.tensor requires
    (`fits`: checked at the smallest and the largest). A numpy array or a tensor is cast
    instead, wrapping, and floats given for a float dtype round, to an infinity when they
    are too large: both as in torch."""
    if not dtype.is_int or arr.size == 0 or (arr.dtype != object and np.can_cast(arr.dtype, numpy_dtype(dtype))):
        return
    flat = arr.ravel()
    ends = (min(flat.tolist()), max(flat.tolist())) if arr.dtype == object else (flat.min().item(), flat.max().item())
    for v in ends:
        check_fits("tensor", v, dtype)


def _to_array(data: Any, dtype: DType | None) -> np.ndarray:
    if isinstance(data, Tensor):
        arr = data.numpy()
    else:
        if hasattr(data, "detach") and hasattr(data, "numpy") and type(data).__module__.startswith("torch"):
            bf16 = str(data.dtype) == "torch.bfloat16"  # torch's .numpy() has no bf16; via f32 is exact
            data = data.detach().cpu()
            data = data.float().numpy().astype(numpy_dtype(bfloat16)) if bf16 else data.numpy()
        try:
            arr = np.asarray(data)
        except ValueError as e:  # ragged nested lists
            raise error(ErrorCode.SHAPE_MISMATCH, f"cannot make a tensor from this data: {e}") from None
    if dtype is None:
        from_python = not isinstance(data, (np.ndarray, np.generic))  # numpy data keeps its dtype
        if arr.dtype == np.float64 and from_python:
            dtype = DEFAULT_FLOAT  # Python floats become the default float, as in torch
        elif arr.dtype.kind == "i" and from_python:
            dtype = int64
        else:
            try:
                dtype = dtype_of_numpy(arr.dtype)
            except KeyError:
                raise error(ErrorCode.UNKNOWN_DTYPE, f"cannot make a tensor from numpy dtype {arr.dtype}") from None
    elif not isinstance(data, (Tensor, np.ndarray)):
        _check_numbers(arr, dtype)
    return np.array(arr, dtype=numpy_dtype(dtype), copy=True)


def tensor(data: Any, dtype: Any = None, requires_grad: bool = False, *, device: Any = None) -> Tensor:
    """A new leaf tensor holding a copy of `data` (nested lists, scalars, numpy, torch)."""
    _on(device, "tensor")
    return Tensor.from_numpy(_to_array(data, as_dtype(dtype) if dtype is not None else None), requires_grad)


def from_numpy(array: np.ndarray) -> Tensor:
    """A leaf tensor over `array`'s data (no copy when it is contiguous)."""
    return Tensor.from_numpy(array)


def from_dlpack(obj: Any) -> Tensor:
    """A tensor over the memory of `obj` (a torch tensor, a numpy array: anything with
    `__dlpack__` on the CPU), bfloat16 included."""
    return Tensor.from_numpy(dlpack.to_numpy(obj))


def _shape(size: Sequence, dtype: DType) -> tuple[int, ...]:
    """The shape `size` names (sizes, or one tuple or list of them), checked before any
    memory is allocated, so a bad size is an error at the user's line and not numpy's from
    deep inside: each dim an integer >= 0, and the tensor no larger than the memory free."""
    while len(size) == 1 and isinstance(size[0], (tuple, list)):  # full((2, 3)), zeros((2, 3)), zeros([(2, 3)])
        size = size[0]
    shape = []
    for k, s in enumerate(size):
        try:
            n = operator.index(s)
        except TypeError:
            raise error(ErrorCode.INVALID_DIM, f"size {k} must be an integer, found {s!r} of type "
                        f"{type(s).__name__}") from None
        if n < 0:
            raise error(ErrorCode.INVALID_DIM, f"size {k} must be >= 0, found {n} (in the shape {tuple(size)})")
        shape.append(n)
    check_free(math.prod(shape) * numpy_dtype(dtype).itemsize, f"a {dtype} tensor of shape {tuple(shape)}")
    return tuple(shape)


def _on(device: Any, what: str) -> None:
    """A creation function's `device`: None or the CPU (check_device raises for another)."""
    if device is not None:
        check_device(device, f"dtm.{what}")


def full(size: Sequence[int], fill_value: Any, dtype: Any = None, requires_grad: bool = False, *,
         device: Any = None) -> Tensor:
    """torch.full: a value that does not fit the dtype raises (E0410), else it converts as
    torch converts it (-1 fills a uint8 tensor with 255)."""
    _on(device, "full")
    d = as_dtype(dtype) if dtype is not None else result_type(fill_value)
    if isinstance(fill_value, (bool, int, float, np.generic)):
        fill_value = fill_value.item() if isinstance(fill_value, np.generic) else fill_value
        check_fits("full", fill_value, d)
        fill_value = convert_scalar(fill_value, d)
    return Tensor.from_numpy(np.full(_shape([size], d), fill_value, dtype=numpy_dtype(d)), requires_grad)


def zeros(*size, dtype: Any = None, device: Any = None, requires_grad: bool = False) -> Tensor:
    """torch.zeros. The pages come zeroed from the system and stay untouched until written
    (np.zeros, not a fill): a model built to be loaded (`nn.no_init`) holds no memory for
    weights that are replaced before they are read."""
    _on(device, "zeros")
    d = as_dtype(dtype) if dtype is not None else DEFAULT_FLOAT
    return Tensor.from_numpy(np.zeros(_shape([size], d), dtype=numpy_dtype(d)), requires_grad)


def ones(*size, dtype: Any = None, device: Any = None, requires_grad: bool = False) -> Tensor:
    _on(device, "ones")
    return full(size, 1, dtype if dtype is not None else DEFAULT_FLOAT, requires_grad=requires_grad)


def zeros_like(t: Tensor, dtype: Any = None, *, device: Any = None) -> Tensor:
    _on(device, "zeros_like")
    return zeros(t.shape, dtype=dtype if dtype is not None else t.dtype)


def ones_like(t: Tensor, dtype: Any = None, *, device: Any = None) -> Tensor:
    _on(device, "ones_like")
    return ones(t.shape, dtype=dtype if dtype is not None else t.dtype)


def full_like(t: Tensor, fill_value: Any, dtype: Any = None, *, device: Any = None) -> Tensor:
    _on(device, "full_like")
    return full(t.shape, fill_value, dtype=dtype if dtype is not None else t.dtype)


def _arange_length(start, end, step) -> int:
    """How many values arange(start, end, step) holds, with torch's checks: a nonzero step,
    finite bounds and a step that goes from start toward end (torch raises otherwise)."""
    if step == 0:
        raise error(ErrorCode.ATTRIBUTE_VALUE, "arange: step must be nonzero")
    if not all(math.isfinite(v) for v in (start, end, step) if not isinstance(v, (int, np.integer))):
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"arange: unsupported range {start} -> {end} with step {step}")
    if (end - start) * step < 0:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"arange: the bounds {start} -> {end} run against the step {step}")
    if all(isinstance(v, (int, np.integer)) for v in (start, end, step)):
        return -(-(end - start) // step)  # exact for any Python int
    return math.ceil((end - start) / step)


def arange(start, end=None, step=1, dtype: Any = None, *, device: Any = None) -> Tensor:
    _on(device, "arange")
    if end is None:
        start, end = 0, start
    d = as_dtype(dtype) if dtype is not None else result_type(start, end, step)
    _shape((_arange_length(start, end, step),), d)  # checked before numpy allocates it
    return Tensor.from_numpy(np.arange(start, end, step).astype(numpy_dtype(d)))


class Generator:
    """torch.Generator: a seed and a count of draws. Random numbers come from the IR's
    counter-based `random` op, keyed by (seed, draw number), so every backend draws the
    same numbers for the same seed, and a generator seeded like the default one draws
    what the default one would."""

    def __init__(self, device: str = "cpu"):
        check_device(device, "dtm.Generator")
        self.manual_seed(0)

    def manual_seed(self, seed: int) -> "Generator":
        self._seed = int(seed) & 0xFFFFFFFF
        self.counter = 0
        return self

    def initial_seed(self) -> int:
        return self._seed

    def seed(self) -> int:
        """Seed from the OS's entropy, as torch's Generator.seed(); the new seed."""
        self.manual_seed(int.from_bytes(os.urandom(4), "little"))
        return self._seed

    def get_state(self) -> Tensor:
        return Tensor.from_numpy(np.array([self._seed, self.counter], dtype=np.int64))

    def set_state(self, state: Tensor) -> "Generator":
        self._seed, self.counter = (int(v) for v in np.asarray(state.numpy()).reshape(2))
        return self

    def next_key(self) -> np.ndarray:
        """The `random` op's key for the next draw: (seed, draw number)."""
        k = np.array([self._seed, self.counter & 0xFFFFFFFF], dtype=np.uint32)
        self.counter += 1
        return k

    def key(self) -> Tensor:
        return Tensor.from_numpy(self.next_key())


GENERATOR = Generator()


def manual_seed(seed: int) -> Generator:
    return GENERATOR.manual_seed(seed)


def _random(size, distribution: str, dtype: Any, requires_grad: bool, generator: Generator | None = None) -> Tensor:
    d = as_dtype(dtype) if dtype is not None else DEFAULT_FLOAT
    t = TensorType(d, _shape(size, d))
    gen = generator or GENERATOR
    key = gen.key()
    with no_grad():
        out = apply("random", key, type=t, distribution=distribution)
    if STATE.trace is not None and not requires_grad:
        # inside dtm.jit (dropout in a compiled step): the key is a parameter of the program,
        # drawn afresh before each replay, so every call draws what the eager call would
        on_replay(lambda: setattr(key, "_buffer", gen.next_key()))
        return out
    out.realize()
    out = Tensor(out._type, buffer=out._buffer)
    return out.requires_grad_(True) if requires_grad else out


def randn(*size, generator: Generator | None = None, dtype: Any = None, device: Any = None,
          requires_grad: bool = False) -> Tensor:
    """torch.randn: standard normal numbers from the spec's counter-based `random` op (the
    same numbers on every backend for the same seed)."""
    _on(device, "randn")
    return _random(size, "normal", dtype, requires_grad, generator)


def rand(*size, generator: Generator | None = None, dtype: Any = None, device: Any = None,
         requires_grad: bool = False) -> Tensor:
    """torch.rand: uniform numbers in [0, 1) from the spec's counter-based `random` op (the
    same numbers on every backend for the same seed)."""
    _on(device, "rand")
    return _random(size, "uniform", dtype, requires_grad, generator)


def randint(low: int, high: int | None = None, size: Sequence[int] | None = None, *,
            generator: Generator | None = None, dtype: Any = None, device: Any = None,
            requires_grad: bool = False) -> Tensor:
    """torch.randint: integers uniform in [low, high) (randint(high, size) starts at 0),
    int64 by default: floor(low + u * (high - low)) of an f64 uniform u."""
    _on(device, "randint")
    if size is None:  # randint(high, size)
        if high is None:
            raise error(ErrorCode.ATTRIBUTE_VALUE, "randint: needs high and size")
        low, high, size = 0, low, high
    if high is None:
        raise error(ErrorCode.ATTRIBUTE_VALUE, "randint: needs high and size")
    if high <= low:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"randint: low ({low}) must be below high ({high})")
    u = _random(size, "uniform", "f64", False, generator).numpy()
    # u < 1 in f64, but u * span may round up to span: the min keeps it in range
    values = np.minimum(np.floor(u * (high - low)), high - low - 1).astype(np.int64) + low
    d = as_dtype(dtype) if dtype is not None else int64
    return Tensor.from_numpy(values.astype(numpy_dtype(d)), requires_grad)


def randn_like(t: Tensor, dtype: Any = None, *, device: Any = None) -> Tensor:
    _on(device, "randn_like")
    return randn(t.shape, dtype=dtype if dtype is not None else t.dtype)


def rand_like(t: Tensor, dtype: Any = None, *, device: Any = None) -> Tensor:
    _on(device, "rand_like")
    return rand(t.shape, dtype=dtype if dtype is not None else t.dtype)
