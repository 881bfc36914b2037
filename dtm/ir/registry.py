"""The op registry: one entry per op, the single source of truth (docs/architecture.md).

Each `OpDef` holds the op's operands, attributes and their kinds, its result-type rule, the
spec version that added it, its category and a one-line summary. The parser, printer,
verifier, encoder, builder and the spec's op chapter all read this table; later layers hang
their reference semantics, VJP rules, sharding rules and lowerings off the op *name*.

Print it: `python -m dtm.ir.registry`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

from . import typerules as R
from .types import REDUCE_OPS


class Category(enum.Enum):
    """The kind of op an OpDef is (elementwise unary, reduction, collective, ...); each
    value is the category's name in words."""

    UNARY = "elementwise unary"
    BINARY = "elementwise binary"
    COMPARE = "comparison"
    TERNARY = "elementwise ternary"
    REDUCE = "reduction"
    MOVEMENT = "movement"
    LINALG = "linear algebra"
    CREATION = "creation"
    COMPOSITE = "composite"
    STATE = "state"
    COLLECTIVE = "collective"
    P2P = "point-to-point"
    STORE = "store"
    CALL = "call"
    CHECK = "run-time check"


class AttrKind(enum.Enum):
    """How an attribute is written in text, held in memory, and encoded."""

    INT = "int"                # 3, -1                        -> int
    FLOAT = "float"            # 1e-05, 0.5, inf, nan         -> float (f64)
    OPT_FLOAT = "float?"       # as FLOAT, or absent          -> float | None
    BOOL = "bool"              # true, false                  -> bool
    ENUM = "enum"              # "sum"                        -> str, one of AttrSpec.choices
    STRING = "string"          # "weights/w1"                 -> str
    DTYPE = "dtype"            # bf16                         -> DType
    INTS = "ints"              # [0, 2]                       -> tuple[int, ...]
    DIM = "dim"                # T, 4, 2*S + 1                -> Dim
    DIMS = "dims"              # [B, 128, 2*T]                -> tuple[Dim, ...]
    STRINGS = "strings"        # ["dp", "tp"]                 -> tuple[str, ...]
    MESH = "mesh"              # @m                           -> str (the mesh's name)
    FUNC = "func"              # @f                           -> str (the function's name)
    REFS = "refs"              # [@load, @prep]               -> tuple[str, ...] (task names)
    SCALAR = "scalar"          # 0.5, 3, true: a value of the result's dtype
    LITERAL = "literal"        # [[1.0, 2.0], [3.0, 4.0]]     -> Literal


REQUIRED: Any = object()  # marks an attribute with no default


@dataclass(frozen=True)
class AttrSpec:
    name: str
    kind: AttrKind
    default: Any = REQUIRED
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpDef:
    name: str
    category: Category
    operands: tuple[str, ...]          # names, for errors and docs; "*xs" is variadic
    attrs: tuple[AttrSpec, ...]
    rule: Callable                     # typerules: (name, in_types, attrs, declared, ctx) -> out_types
    results: int = 1                   # -1: as many as the rule returns (call)
    min_operands: int | None = None    # for ops with optional or variadic operands
    declared: bool = False             # the result type is read from the annotation
    effect: bool = False               # orders with other effects; never removed or reordered
    quant_ok: bool = False             # accepts quantized operands
    since: tuple[int, int] = (1, 0)
    summary: str = ""
    attr_index: dict[str, AttrSpec] = field(default_factory=dict, compare=False, repr=False)
    arity: tuple[int, int | None] = field(default=(0, 0), compare=False, repr=False)

    def __post_init__(self):
        self.attr_index.update({a.name: a for a in self.attrs})
        n = len(self.operands)
        low = self.min_operands if self.min_operands is not None else (n - 1 if self.variadic else n)
        # (min, max) operand count; max None when unbounded.
        object.__setattr__(self, "arity", (low, None if self.variadic else n))

    @property
    def variadic(self) -> bool:
        return bool(self.operands) and self.operands[-1].startswith("*")


REGISTRY: dict[str, OpDef] = {}


def _op(name: str, category: Category, operands: tuple[str, ...], rule: Callable, summary: str,
        attrs: tuple[AttrSpec, ...] = (), **kw) -> None:
    assert name not in REGISTRY, name
    REGISTRY[name] = OpDef(name, category, operands, attrs, rule, summary=summary, **kw)


A = AttrSpec
K = AttrKind
C = Category
MESH_GROUP = (A("mesh", K.MESH), A("axes", K.STRINGS))


# --- elementwise unary -----------------------------------------------------------------
for _name, _cls, _doc in [
    ("neg", "numeric", "-x"), ("abs", "numeric", "|x|"), ("sign", "numeric", "-1, 0 or 1 by the sign of x (NaN stays NaN)"),
    ("exp", "float", "e^x"), ("exp2", "float", "2^x"), ("log", "float", "natural logarithm"),
    ("log2", "float", "base-2 logarithm"), ("sqrt", "float", "square root"),
    ("rsqrt", "float", "1 / sqrt(x)"), ("reciprocal", "float", "1 / x"), ("sin", "float", "sine"),
    ("cos", "float", "cosine"), ("tanh", "float", "hyperbolic tangent"), ("erf", "float", "error function"),
    ("sigmoid", "float", "1 / (1 + e^-x)"), ("floor", "float", "round toward -inf"),
    ("ceil", "float", "round toward +inf"), ("round", "float", "round half to even"),
    ("logical_not", "bool", "not x"),
]:
    _op(_name, C.UNARY, ("x",), R.unary(_cls), _doc)
_op("cast", C.UNARY, ("x",), R.cast_rule, "convert each element to dtype `to` (quantizes or dequantizes "
    "when one side is a quantized dtype)", (A("to", K.DTYPE),), quant_ok=True)
_op("bitcast", C.UNARY, ("x",), R.bitcast_rule, "reinterpret the bits of each element as dtype `to` of equal size",
    (A("to", K.DTYPE),))

# --- elementwise binary and comparisons ------------------------------------------------
for _name, _cls, _doc in [
    ("add", "numeric", "x + y"), ("sub", "numeric", "x - y"), ("mul", "numeric", "x * y"),
    ("div", "numeric", "x / y (integers: truncated toward zero)"), ("pow", "float", "x^y"),
    ("max", "numeric", "elementwise maximum (NaN propagates)"), ("min", "numeric", "elementwise minimum (NaN propagates)"),
    ("mod", "numeric", "remainder with the sign of x (C fmod)"),
    ("logical_and", "bool", "x and y"), ("logical_or", "bool", "x or y"), ("logical_xor", "bool", "x xor y"),
]:
    _op(_name, C.BINARY, ("x", "y"), R.binary(_cls), _doc)
for _name, _cls, _doc in [
    ("eq", "any", "x == y"), ("ne", "any", "x != y"), ("lt", "numeric", "x < y"),
    ("le", "numeric", "x <= y"), ("gt", "numeric", "x > y"), ("ge", "numeric", "x >= y"),
]:
    _op(_name, C.COMPARE, ("x", "y"), R.binary(_cls, to_bool=True), _doc)
_op("where", C.TERNARY, ("cond", "x", "y"), R.where_rule, "x where cond is true, else y")

# --- reductions ------------------------------------------------------------------------
for _name, _cls, _doc in [
    ("reduce_sum", "numeric", "sum over `axes`"), ("reduce_prod", "numeric", "product over `axes`"),
    ("reduce_max", "numeric", "maximum over `axes` (NaN propagates)"),
    ("reduce_min", "numeric", "minimum over `axes` (NaN propagates)"),
]:
    _op(_name, C.REDUCE, ("x",), R.reduce_rule(_cls), _doc, (A("axes", K.INTS), A("keepdims", K.BOOL, False)))
for _name, _doc in [("argmax", "index of the first maximum along `axis`"),
                    ("argmin", "index of the first minimum along `axis`")]:
    _op(_name, C.REDUCE, ("x",), R.arg_rule, _doc, (A("axis", K.INT), A("keepdims", K.BOOL, False)))
_op("argsort", C.REDUCE, ("x",), R.argsort_rule,
    "the indices that sort x along `axis` (stable; NaN above every number)",
    (A("axis", K.INT), A("descending", K.BOOL, False)), since=(1, 1))
_op("cumsum", C.REDUCE, ("x",), R.scan_rule,
    "running sum along `axis` (floats accumulate in f64, each element rounded once)", (A("axis", K.INT),),
    since=(1, 1))

# --- movement --------------------------------------------------------------------------
_op("reshape", C.MOVEMENT, ("x",), R.reshape_rule, "the same elements in row-major order, in a new shape",
    (A("shape", K.DIMS),), quant_ok=False)
_op("permute", C.MOVEMENT, ("x",), R.permute_rule, "reorder dims: result dim i is operand dim perm[i]",
    (A("perm", K.INTS),))
_op("broadcast_to", C.MOVEMENT, ("x",), R.broadcast_to_rule, "repeat size-1 and leading dims to `shape` (numpy rules)",
    (A("shape", K.DIMS),))
_op("slice", C.MOVEMENT, ("x",), R.slice_rule, "elements start, start+step, .. < stop along every dim",
    (A("start", K.DIMS), A("stop", K.DIMS), A("step", K.INTS)))
_op("pad", C.MOVEMENT, ("x",), R.pad_rule, "add `low` and `high` elements of `value` around every dim",
    (A("low", K.INTS), A("high", K.INTS), A("value", K.SCALAR, 0.0)))
_op("concat", C.MOVEMENT, ("*xs",), R.concat_rule, "join operands along `axis`", (A("axis", K.INT),),
    min_operands=1)
_op("gather", C.MOVEMENT, ("x", "indices"), R.gather_rule,
    "take slices of x along `axis` at `indices` (numpy.take); a quantized x along a dim other than its last "
    "(whole rows of blocks: an embedding table's rows)", (A("axis", K.INT),), quant_ok=True)
_op("scatter_add", C.MOVEMENT, ("x", "indices", "updates"), R.scatter_add_rule,
    "x with `updates` added at `indices` along `axis` (the transpose of gather)", (A("axis", K.INT),))
_op("flip", C.MOVEMENT, ("x",), R.flip_rule, "reverse the order of elements along `axes`", (A("axes", K.INTS),))
_op("dynamic_slice", C.MOVEMENT, ("x", "start"), R.dynamic_slice_rule,
    "`size` elements along `axis` from a run-time start, clamped into range", (A("axis", K.INT), A("size", K.DIM)))
_op("dynamic_update_slice", C.MOVEMENT, ("x", "update", "start"), R.dynamic_update_slice_rule,
    "x with `update` written along `axis` at a run-time start, clamped into range", (A("axis", K.INT),))

# --- linear algebra --------------------------------------------------------------------
_op("matmul", C.LINALG, ("a", "b"), R.matmul_rule, "matrix product over the last two dims; leading dims broadcast")

# --- creation --------------------------------------------------------------------------
_op("constant", C.CREATION, (), R.constant_rule, "a dense literal", (A("value", K.LITERAL),), declared=True)
_op("full", C.CREATION, (), R.full_rule, "a tensor of the declared type with every element `value`",
    (A("value", K.SCALAR),), declared=True)
_op("iota", C.CREATION, (), R.iota_rule, "each element's index along `dim`", (A("dim", K.INT),), declared=True)
_op("random", C.CREATION, ("key",), R.random_rule,
    "counter-based random numbers from a u32[2] key (uniform in [0, 1) before rounding to the dtype, "
    "or standard normal)",
    (A("distribution", K.ENUM, "uniform", ("uniform", "normal")),), declared=True)

# --- composites (each has a normative decomposition in the spec) -----------------------
_op("softmax", C.COMPOSITE, ("x",), R.softmax_rule, "exp(x - max) / sum(exp(x - max)) along `axis`",
    (A("axis", K.INT),))
_op("log_softmax", C.COMPOSITE, ("x",), R.softmax_rule, "x - max - log(sum(exp(x - max))) along `axis`",
    (A("axis", K.INT),))
_op("layer_norm", C.COMPOSITE, ("x", "weight", "bias"), R.layer_norm_rule,
    "normalise over the last dim, then scale by weight and add bias when given",
    (A("eps", K.FLOAT, 1e-5),), min_operands=1)
_op("gelu", C.COMPOSITE, ("x",), R.unary("float"), "x * Phi(x), exact (erf) or the tanh approximation",
    (A("approximate", K.ENUM, "none", ("none", "tanh")),))
_op("silu", C.COMPOSITE, ("x",), R.unary("float"), "x * sigmoid(x)")
_op("scaled_dot_product_attention", C.COMPOSITE, ("q", "k", "v"), R.sdpa_rule,
    "softmax(q @ k^T * scale [+ causal mask]) @ v", (A("causal", K.BOOL, False), A("scale", K.OPT_FLOAT, None)))

# --- state -----------------------------------------------------------------------------
_op("assign", C.STATE, ("target", "value"), R.assign_rule,
    "overwrite the parameter buffer `target` with `value` in place", results=0, effect=True, quant_ok=True)

# --- collectives and point-to-point ----------------------------------------------------
_op("all_reduce", C.COLLECTIVE, ("x",), R.all_reduce_rule, "reduce x with `op` across the group; every rank gets the result",
    MESH_GROUP + (A("op", K.ENUM, "sum", REDUCE_OPS),), effect=True)
_op("all_gather", C.COLLECTIVE, ("x",), R.all_gather_rule, "concatenate every rank's x along `dim`, in group order",
    MESH_GROUP + (A("dim", K.INT),), effect=True, quant_ok=True)
_op("reduce_scatter", C.COLLECTIVE, ("x",), R.reduce_scatter_rule,
    "reduce with `op` across the group, then rank i keeps block i along `dim`",
    MESH_GROUP + (A("dim", K.INT), A("op", K.ENUM, "sum", REDUCE_OPS)), effect=True)
_op("broadcast", C.COLLECTIVE, ("x",), R.broadcast_rule, "every rank gets group rank `src`'s x",
    MESH_GROUP + (A("src", K.INT, 0),), effect=True, quant_ok=True)
_op("all_to_all", C.COLLECTIVE, ("x",), R.all_to_all_rule,
    "split x along `split_dim`, send block j to group rank j, concatenate the received blocks along `concat_dim`",
    MESH_GROUP + (A("split_dim", K.INT), A("concat_dim", K.INT)), effect=True, quant_ok=True)
_op("barrier", C.COLLECTIVE, (), R.barrier_rule, "return once every rank of the group has reached it",
    MESH_GROUP, results=0, effect=True)
_op("send", C.P2P, ("x",), R.send_rule, "send x to group rank `dst`", MESH_GROUP + (A("dst", K.INT),),
    results=0, effect=True, quant_ok=True)
_op("recv", C.P2P, (), R.recv_rule, "receive a tensor of the declared type from group rank `src`",
    MESH_GROUP + (A("src", K.INT),), declared=True, effect=True)

# --- tensor store (L2) and calls -------------------------------------------------------
_op("store_get", C.STORE, (), R.store_get_rule, "read the tensor stored under `key`; its type is declared",
    (A("key", K.STRING),), declared=True, effect=True)
_op("store_put", C.STORE, ("x",), R.no_result_rule, "store x under `key`, replacing any earlier tensor",
    (A("key", K.STRING),), results=0, effect=True, quant_ok=True)
_op("call", C.CALL, ("*args",), R.call_rule, "call function `callee`; results are its results",
    (A("callee", K.FUNC),), results=-1, quant_ok=True)

# --- run-time checks -------------------------------------------------------------------
_op("check", C.CHECK, ("x", "fault"), R.check_rule,
    "x itself; a run-time error with `code` when any element of `fault` is true (a front end's check of "
    "values computed in the program: indices, divisors)",
    (A("code", K.STRING), A("message", K.STRING), A("where", K.STRING, "")), since=(1, 1))

# The collectives (barrier included), in registry order: every layer that runs or names them
# (the reference, L0, L1, the wire's CollectiveStart) reads this tuple.
COLLECTIVES: tuple[str, ...] = tuple(n for n, d in REGISTRY.items() if d.category is C.COLLECTIVE)

# Attributes of a module-level task declaration (not an op: it names a function to run).
TASK_ATTRS: dict[str, AttrSpec] = {a.name: a for a in (
    A("inputs", K.STRINGS), A("outputs", K.STRINGS), A("after", K.REFS, ()))}


def table() -> str:
    """The registry as a table, one op a line."""
    rows = [f"{'op':30} {'category':20} {'since':6} operands / attributes"]
    for d in REGISTRY.values():
        attrs = ", ".join(f"{a.name}: {a.kind.value}" + ("" if a.default is REQUIRED else f" = {a.default!r}")
                          for a in d.attrs)
        rows.append(f"{d.name:30} {d.category.value:20} {d.since[0]}.{d.since[1]:<4} "
                    f"({', '.join(d.operands)}) {{{attrs}}}")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
