"""The reference semantics of DTM IR (layer 2): a clear numpy implementation of every op,
the oracle every faster backend is tested against.

    from dtm.ref import run, run_spmd, RefContext, IMPLS
    outs = run(module, "f", [x, w])                            # one device
    outs = run_spmd(module, "f", [[x0, w], [x1, w]], "mesh")   # one thread per rank (L0)
"""

from . import collectives  # noqa: F401 - registers the collectives and send/recv into IMPLS
from .context import Comm, RefContext
from .interpreter import run
from .local_group import LocalGroup, run_spmd
from .ops import IMPLS
from .quant import dequantize, quantize, storage_dtype, storage_shape

__all__ = ["run", "run_spmd", "RefContext", "Comm", "LocalGroup", "IMPLS", "quantize", "dequantize",
           "storage_shape", "storage_dtype"]
