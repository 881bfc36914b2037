"""Tensor types and shardings: the values the type rules compute with.

`TensorType` is an element type plus a shape of dims (static ints or symbolic `SymDim`s).
`Sharding` places a value on a mesh: one `Placement` per mesh axis, in the mesh's axis
order: `Shard(dim)`, `Replicate()` or `Partial(op)`. All are immutable and hashable, so
type rules can be memoised on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import DType, from_numpy, numpy_dtype
from .symbolic import Dim, format_dim

REDUCE_OPS = ("sum", "prod", "max", "min", "avg")


class TensorType:
    """An immutable tensor type. The hash is computed once: type rules are memoised on
    tuples of types, so types are hashed far more often than they are built."""

    __slots__ = ("dtype", "shape", "_hash")

    def __init__(self, dtype: DType, shape: tuple[Dim, ...]):
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "_hash", hash((dtype.name, shape)))

    def __setattr__(self, name, value):
        raise AttributeError("TensorType is immutable")

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, TensorType) and self._hash == other._hash
                                 and self.dtype is other.dtype and self.shape == other.shape)

    def __hash__(self) -> int:
        return self._hash

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def with_shape(self, shape) -> "TensorType":
        return TensorType(self.dtype, tuple(shape))

    def with_dtype(self, dtype: DType) -> "TensorType":
        return TensorType(dtype, self.shape)

    def __str__(self) -> str:
        return f"{self.dtype.name}[{', '.join(format_dim(d) for d in self.shape)}]"

    __repr__ = __str__


@dataclass(frozen=True, slots=True)
class Placement:
    """kind is "shard" (arg: the tensor dim), "replicate" (arg None) or "partial" (arg: the
    pending reduce op, one of REDUCE_OPS)."""

    kind: str
    arg: int | str | None = None

    def __str__(self) -> str:
        return self.kind if self.arg is None else f"{self.kind}({self.arg})"

    __repr__ = __str__


def Shard(dim: int) -> Placement:  # noqa: N802 - reads like the placement it builds
    """The placement shard(dim) (spec 2.7): the devices along a mesh axis hold consecutive
    chunks of tensor dim `dim`. Checked where it is used, not here: by IR verification
    (E0502), or by a dtm.parallel mesh, which also takes a negative dim from the end."""
    return Placement("shard", dim)


def Replicate() -> Placement:  # noqa: N802
    """The placement replicate (spec 2.7): every device along a mesh axis holds the same piece."""
    return Placement("replicate")


def Partial(op: str = "sum") -> Placement:  # noqa: N802
    """The placement partial(op) (spec 2.7): the value is the reduction with `op` (sum,
    prod, max, min or avg) of the pieces the devices along a mesh axis hold. `op` is checked
    where the placement is used (E0507), not here."""
    return Placement("partial", op)


@dataclass(frozen=True, slots=True)
class Sharding:
    mesh: str  # name of a mesh declared in the module, without the @
    placements: tuple[Placement, ...]

    def __str__(self) -> str:
        return f"@{self.mesh}[{', '.join(str(p) for p in self.placements)}]"

    __repr__ = __str__


@dataclass(frozen=True, slots=True)
class Mesh:
    """A named grid of devices: ordered axes with their sizes."""

    name: str
    axes: tuple[tuple[str, int], ...]

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes)

    def axis_size(self, axis: str) -> int:
        return dict(self.axes)[axis]

    @property
    def size(self) -> int:
        n = 1
        for _, s in self.axes:
            n *= s
        return n

    def __str__(self) -> str:
        return f"mesh @{self.name}[{', '.join(f'{a} = {s}' for a, s in self.axes)}]"


@dataclass(frozen=True, slots=True)
class Literal:
    """A dense constant: row-major little-endian element bytes of a static shape."""

    dtype: DType
    shape: tuple[int, ...]
    data: bytes

    @staticmethod
    def from_numpy(array) -> "Literal":
        arr = np.asarray(array)
        arr = arr if arr.flags.c_contiguous else arr.copy(order="C")  # keeps 0-d arrays 0-d
        dtype = from_numpy(arr.dtype)
        if dtype.name == "bool":
            arr = arr.view(np.uint8) != 0  # one byte pattern per truth value: 0 or 1
        if dtype.is_float:
            nan = np.isnan(arr.astype(np.float64))  # exact for every float dtype
            if nan.any():
                arr = np.where(nan, np.array(np.nan, arr.dtype), arr)  # one NaN bit pattern
        return Literal(dtype, tuple(int(d) for d in arr.shape), arr.astype(arr.dtype.newbyteorder("<")).tobytes())

    def to_numpy(self):
        dt = numpy_dtype(self.dtype).newbyteorder("<")
        return np.frombuffer(self.data, dtype=dt).reshape(self.shape).astype(numpy_dtype(self.dtype))
