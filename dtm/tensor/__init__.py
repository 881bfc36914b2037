"""The lazy `Tensor`: ops record, `realize()` runs.

Every op on a Tensor checks its types at once (with the op's type rule from the registry,
so a mistake is reported at the user's line) and records a node. `realize()`, `.numpy()`
or `.item()` turn the pending nodes into one IR function (`capture`) and hand it to the
runtime (`dtm.runtime.execute.run`), which picks the executor from what the function holds:
one device (the `cpu` backend by default; `DTM_BACKEND` or the `backend=` argument
chooses), or the devices of the mesh its distributed values are on. Realized tensors keep
their graph while they require grad, so `backward()` can capture the forward program and
differentiate it as IR (dtm.compiler.autodiff).

A distributed tensor (made by dtm.parallel) records its mesh and placements like its
dtype: they become the shardings of the captured IR's values (spec 2.7).

    core.py      the Tensor class, grad mode, recording (`apply`), `capture`, `realize`,
                 `backward`, and the tracing state of dtm.jit
    dtypes.py    torch's dtype names, `as_dtype`, `promote_types`
    creation.py  tensor(), from_numpy, zeros / ones / full / arange, randn / rand / randint, Generator
    extra_ops.py ops composed from functional.py's (einsum, topk, ...), sort and cumsum
    jit.py       dtm.jit

The ops themselves are in dtm/functional.py, which attaches the Tensor's operators and op
methods (`x + y`, `x.sum()`) from its `_METHODS` table.
"""

from ..errors import user_error as error
from .core import (STATE, Tensor, apply, backward, capture, enable_grad, inference_mode, is_grad_enabled, no_grad,
                   normalize_dim, realize, result_type)
from .creation import (Generator, arange, from_dlpack, from_numpy, full, full_like, manual_seed, ones, ones_like, rand,
                       rand_like, randint, randn, randn_like, tensor, zeros, zeros_like)
from .dtypes import (DEFAULT_FLOAT, as_dtype, bfloat16, bool_, float8_e4m3, float8_e4m3fn, float8_e5m2, float16, float32, float64,
                     int8, int16, int32, int64, promote_types, uint8, uint16, uint32, uint64)
from .jit import jit

__all__ = [
    "Tensor", "tensor", "from_numpy", "from_dlpack", "zeros", "ones", "full", "zeros_like", "ones_like",
    "full_like", "arange", "randn", "rand", "randn_like", "rand_like", "manual_seed", "no_grad",
    "enable_grad", "inference_mode", "Generator", "randint",
    "is_grad_enabled", "jit", "realize", "backward", "as_dtype", "promote_types", "result_type", "apply",
    "capture", "normalize_dim", "error", "STATE", "DEFAULT_FLOAT",
    "float16", "bfloat16", "float32", "float64", "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "int8", "int16", "int32",
    "int64", "uint8", "uint16", "uint32", "uint64", "bool_",
]
