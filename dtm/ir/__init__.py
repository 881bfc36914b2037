"""DTM IR: types, the op registry, text format, verifier, canonical encoding and hash.

    module = dtm.ir.parse(text)      # text -> Module           (IRError on bad input)
    dtm.ir.verify(module)            # typecheck                 (IRError on the first fault)
    dtm.ir.format(module)            # Module -> canonical text
    module.hash()                    # hex sha256 of dtm.ir.encode(module)
    dtm.ir.decode(dtm.ir.encode(module)) == module
"""

from .builder import Builder, FuncBuilder, sharding, tensor_type
from .diagnostics import IRError, render
from .dtypes import DTYPES, DType
from .decoding import decode
from .encoding import encode
from .module import Func, Module, Op, Task, Value
from .parser import parse
from .printer import format
from .registry import REGISTRY, AttrKind, Category, OpDef
from .symbolic import SymDim, sym
from .types import Literal, Mesh, Partial, Placement, Replicate, Shard, Sharding, TensorType
from .verifier import verify
from .version import SPEC_VERSION

__all__ = [
    "parse", "format", "verify", "encode", "decode", "IRError", "render",
    "Module", "Func", "Op", "Task", "Value", "Builder", "FuncBuilder", "tensor_type", "sharding",
    "REGISTRY", "OpDef", "AttrKind", "Category", "DTYPES", "DType", "TensorType", "SymDim", "sym",
    "Mesh", "Sharding", "Placement", "Shard", "Replicate", "Partial", "Literal", "SPEC_VERSION",
]
