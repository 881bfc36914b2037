"""The typechecker (spec section "Verification"): every rule a valid module obeys.

In order: meshes; per function, parameter types and shardings, then each op (known op,
operand count, operands defined before use and not consumed by `assign`, attributes, result
count, result types equal to what the op's type rule infers, shardings valid, symbols
bound), then the returned values against the signature; last, task declarations (function
exists, arity fits, `after` names tasks, no cycles). The first violation raises `IRError`.

Type rules are memoised on (op, attributes, operand types, declared types): a model repeats
the same few signatures thousands of times.
"""

from __future__ import annotations

import operator
import re

from ..errors import ErrorCode as E
from .attrs import MAX_DIM, MAX_RANK, normalize_attrs
from .diagnostics import IRError
from .encoding import attr_bytes
from .gcpause import gc_paused
from .module import Func, Module, Op, Value
from .registry import REGISTRY, OpDef
from .symbolic import MAX_DEGREE, SymDim
from .typerules import TypeRuleError, check_quant_shape
from .types import REDUCE_OPS, Sharding, TensorType


_TYPE = operator.attrgetter("type")

# Names the text format can write (spec 4.2): @names, and identifiers for axes and symbols.
GLOBAL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Checker:
    def __init__(self, module: Module):
        self.module = module
        self.memo: dict = {}
        self.checked_types: set = set()

    def fail(self, code: E, message: str, loc=None):
        line, col = loc if loc else (None, None)
        raise IRError(code, message, line, col)

    # -- meshes and shardings --
    def name(self, name: str, what: str, pattern, loc=None) -> None:
        """Names from Python or from bytes must be ones the text format can write."""
        if not isinstance(name, str) or not pattern.fullmatch(name):
            self.fail(E.INVALID_NAME, f"{what} {name!r} is not a name the text format can write "
                      f"({pattern.pattern})", loc)

    def mesh(self, mesh) -> None:
        self.name(mesh.name, "mesh", GLOBAL_NAME)
        for a, _ in mesh.axes:
            self.name(a, f"mesh @{mesh.name}: axis", IDENT)
        names = [a for a, _ in mesh.axes]
        if not names:
            self.fail(E.INVALID_MESH, f"mesh @{mesh.name} has no axes")
        if len(set(names)) != len(names):
            self.fail(E.INVALID_MESH, f"mesh @{mesh.name} repeats an axis: {names}")
        for a, size in mesh.axes:
            if not isinstance(size, int) or not 1 <= size < MAX_DIM:
                self.fail(E.INVALID_MESH, f"mesh @{mesh.name}: axis {a!r} has size {size}; sizes must be in [1, 2^62)")

    def sharding(self, t: TensorType, sh: Sharding, what: str, loc) -> None:
        key = (t, sh)
        if key in self.checked_types:
            return
        mesh = self.module.meshes.get(sh.mesh)
        if mesh is None:
            self.fail(E.UNDEFINED_MESH, f"{what}: mesh @{sh.mesh} is not declared", loc)
        if len(sh.placements) != len(mesh.axes):
            self.fail(E.PLACEMENT_COUNT, f"{what}: {sh} has {len(sh.placements)} placement(s); mesh @{mesh.name} "
                      f"has {len(mesh.axes)} axes {list(mesh.axis_names)} and needs one placement per axis", loc)
        sharded_by: dict[int, str] = {}
        for (axis, _), p in zip(mesh.axes, sh.placements):
            if p.kind == "shard":
                if not isinstance(p.arg, int) or not 0 <= p.arg < t.rank:
                    self.fail(E.SHARD_DIM_OUT_OF_RANGE, f"{what}: shard({p.arg}) on mesh axis {axis!r}, "
                              f"but {t} has dims 0..{t.rank - 1}", loc)
                if p.arg in sharded_by:
                    self.fail(E.DIM_SHARDED_TWICE, f"{what}: dim {p.arg} of {t} is sharded by both mesh axes "
                              f"{sharded_by[p.arg]!r} and {axis!r}", loc)
                sharded_by[p.arg] = axis
            elif p.kind == "partial":
                if p.arg not in REDUCE_OPS:
                    self.fail(E.INVALID_PLACEMENT, f"{what}: partial({p.arg}) needs one of {', '.join(REDUCE_OPS)}", loc)
            elif p.kind != "replicate":
                self.fail(E.INVALID_PLACEMENT, f"{what}: unknown placement {p}", loc)
        self.checked_types.add(key)

    def value_type(self, t: TensorType, sh: Sharding | None, bound: set[str] | None, what: str, loc) -> None:
        """Dims in [0, 2^62), quantized shapes whole blocks, symbols bound, sharding valid."""
        if t not in self.checked_types:
            if len(t.shape) > MAX_RANK:
                self.fail(E.INVALID_DIM, f"{what}: rank {len(t.shape)} exceeds the limit {MAX_RANK}", loc)
            for d in t.shape:
                if isinstance(d, int) and not 0 <= d < MAX_DIM:
                    self.fail(E.INVALID_DIM, f"{what}: {t} has dim {d} outside [0, 2^62)", loc)
                if isinstance(d, SymDim) and max(len(m) for m, _ in d.terms) > MAX_DEGREE:
                    self.fail(E.INVALID_DIM, f"{what}: {t} has a dim of degree above {MAX_DEGREE}", loc)
            try:
                check_quant_shape(t)
            except TypeRuleError as e:
                self.fail(e.code, f"{what}: {e.message}", loc)
            self.checked_types.add(t)
        if bound is not None:
            for d in t.shape:
                if isinstance(d, SymDim) and not d.symbols <= bound:
                    missing = ", ".join(sorted(d.symbols - bound))
                    self.fail(E.UNBOUND_SYMBOL, f"{what}: symbol {missing} in {t} is not bound by a parameter", loc)
        if sh is not None:
            self.sharding(t, sh, what, loc)

    # -- functions --
    def func(self, f: Func) -> None:
        self.name(f.name, "function", GLOBAL_NAME, f.loc)
        bound: set[str] = set()
        for p in f.params:
            self.value_type(p.type, p.sharding, None, f"@{f.name} parameter %{p.name}", f.loc)
            for d in p.type.shape:
                if isinstance(d, SymDim):
                    for s in d.symbols:
                        self.name(s, f"@{f.name} parameter %{p.name}: symbol", IDENT, f.loc)
                    bound |= d.symbols
        for t, sh in f.result_types:
            self.value_type(t, sh, bound, f"@{f.name} result type", f.loc)
        scope = _Scope(f)
        for op in f.ops:
            self.op(scope, op, bound)
        if len(f.returns) != len(f.result_types):
            self.fail(E.RETURN_MISMATCH, f"@{f.name} returns {len(f.returns)} value(s); its signature declares "
                      f"{len(f.result_types)}", f.return_loc)
        for i, (v, (t, _)) in enumerate(zip(f.returns, f.result_types)):
            self.use(scope, v, f.return_loc, "return")
            if v.type != t:
                self.fail(E.RETURN_MISMATCH, f"@{f.name} result {i}: returns {v.type}, the signature declares {t}",
                          f.return_loc)

    def use(self, scope: "_Scope", v: Value, loc, opname: str) -> None:
        if v not in scope.defined:
            self.fail(E.UNDEFINED_VALUE, f"{opname}: operand %{v.name} is not defined before this point "
                      f"in @{scope.func.name}", loc)
        if v in scope.assigned:
            self.fail(E.USE_AFTER_ASSIGN, f"{opname}: %{v.name} was overwritten by assign earlier in "
                      f"@{scope.func.name}; use the assigned value instead", loc)

    def op(self, scope: "_Scope", op: Op, bound: set[str]) -> None:
        loc = op.loc
        opdef: OpDef | None = REGISTRY.get(op.name)
        if opdef is None:
            self.fail(E.UNKNOWN_OP, f"unknown op {op.name!r}", loc)
        operands, results = op.operands, op.results
        n = len(operands)
        lo, hi = opdef.arity
        if n < lo or (hi is not None and n > hi):
            want = f"{lo}" if lo == hi else (f"at least {lo}" if hi is None else f"{lo} to {hi}")
            self.fail(E.OPERAND_COUNT, f"{op.name} takes {want} operand(s) ({', '.join(opdef.operands)}), found {n}", loc)
        defined = scope.defined
        if scope.assigned or op.name == "assign":
            self.effects(scope, op, loc)
        else:
            for v in operands:
                if v not in defined:
                    self.use(scope, v, loc, op.name)
        declared = tuple(map(_TYPE, results))
        key = (op.name, op.attrs_key, tuple(map(_TYPE, operands)), declared)
        if key not in self.memo:
            # Only a signature that checks out is memoised, so a hit needs no comparison.
            if self.module.version is not None and opdef.since > self.module.version:
                v = self.module.version
                self.fail(E.OP_NEWER_THAN_TARGET, f"{op.name} was added in spec {opdef.since[0]}.{opdef.since[1]}; "
                          f"this module declares version {v[0]}.{v[1]}", loc)
            if opdef.results >= 0 and len(results) != opdef.results:
                self.fail(E.RESULT_COUNT, f"{op.name} has {opdef.results} result(s), found {len(results)}", loc)
            inferred = self.infer(opdef, op, key[2], declared, loc)
            if len(inferred) != len(declared):
                self.fail(E.RESULT_COUNT, f"{op.name} has {len(inferred)} result(s), found {len(declared)}", loc)
            for r, t in zip(results, inferred):
                if r.type != t:
                    self.fail(E.RESULT_TYPE_MISMATCH, f"{op.name}: result %{r.name} is declared {r.type}, "
                              f"the op gives {t}", loc)
            self.memo[key] = True
        checked = scope.checked
        for r in results:
            if r.sharding is not None or r.type not in checked:
                self.value_type(r.type, r.sharding, bound, f"{op.name} result %{r.name}", loc)
                if r.sharding is None:
                    checked.add(r.type)
            defined.add(r)

    def effects(self, scope: "_Scope", op: Op, loc) -> None:
        """Operands of a function that has used `assign`: none may name a consumed parameter."""
        for v in op.operands:
            self.use(scope, v, loc, op.name)
        if op.name == "assign":
            target = op.operands[0]
            if target not in scope.params:
                self.fail(E.ATTRIBUTE_VALUE, f"assign: the target %{target.name} must be a parameter "
                          f"of @{scope.func.name}", loc)
            scope.assigned.add(target)

    def infer(self, opdef: OpDef, op: Op, in_types, declared, loc) -> tuple[TensorType, ...]:
        try:
            if not opdef.quant_ok:
                for t in in_types:
                    if t.dtype.is_quant:
                        raise TypeRuleError(E.QUANTIZED_MISUSE, f"{op.name} does not take quantized {t}; "
                                            "cast it to a float dtype first")
            # Attributes built by hand may skip the parser's checks: check them once here, and
            # give the rule the checked values.
            attrs = normalize_attrs(op.name, opdef.attr_index, op.attrs, declared[0].dtype if declared else None)
            if not _same_attrs(opdef, attrs, op.attrs):
                missing = sorted(set(attrs) - set(op.attrs))
                raise TypeRuleError(E.MISSING_ATTRIBUTE if missing else E.ATTRIBUTE_VALUE,
                                    f"{op.name}: attributes are not in canonical form"
                                    + (f" (missing {', '.join(missing)})" if missing else ""))
            return tuple(opdef.rule(op.name, in_types, attrs, declared, self.module))
        except TypeRuleError as e:
            self.fail(e.code, e.message, loc)

    # -- tasks --
    def tasks(self) -> None:
        m = self.module
        for t in m.tasks.values():
            self.name(t.name, "task", GLOBAL_NAME, t.loc)
            for key in t.inputs + t.outputs:
                if not isinstance(key, str):
                    self.fail(E.ATTRIBUTE_TYPE, f"task @{t.name}: store keys are strings, found {key!r}", t.loc)
            f = m.funcs.get(t.func)
            if f is None:
                self.fail(E.UNDEFINED_FUNC, f"task @{t.name}: function @{t.func} is not defined", t.loc)
            if len(t.inputs) != len(f.params):
                self.fail(E.OPERAND_COUNT, f"task @{t.name}: @{f.name} takes {len(f.params)} input(s), "
                          f"inputs names {len(t.inputs)}", t.loc)
            if len(t.outputs) != len(f.result_types):
                self.fail(E.RESULT_COUNT, f"task @{t.name}: @{f.name} has {len(f.result_types)} result(s), "
                          f"outputs names {len(t.outputs)}", t.loc)
            if list(t.after) != sorted(set(t.after)):
                self.fail(E.ATTRIBUTE_VALUE, f"task @{t.name}: after must be sorted and without repeats "
                          "(its canonical form)", t.loc)
            for a in t.after:
                if a not in m.tasks:
                    self.fail(E.UNDEFINED_TASK, f"task @{t.name}: after names @{a}, which is not a task", t.loc)
        cycle = _find_cycle({name: t.after for name, t in m.tasks.items()})
        if cycle:
            self.fail(E.TASK_CYCLE, f"task @{cycle} depends on itself through after", m.tasks[cycle].loc)

    def calls(self) -> None:
        """A function may not call itself, directly or through others: calls must end."""
        edges = {name: tuple(op.attrs["callee"] for op in f.ops if op.name == "call") for name, f in self.module.funcs.items()}
        cycle = _find_cycle(edges)
        if cycle:
            self.fail(E.CALL_CYCLE, f"function @{cycle} calls itself (directly or through other functions)",
                      self.module.funcs[cycle].loc)


def _same_attrs(opdef: OpDef, a: dict, b: dict) -> bool:
    """Attribute dicts with the same canonical bytes: `1` is not `1.0`, and a NaN with a
    payload is not the canonical NaN."""
    if a.keys() != b.keys():
        return False
    for k in a:
        try:
            if attr_bytes(opdef.attr_index[k], a[k]) != attr_bytes(opdef.attr_index[k], b[k]):
                return False
        except (AttributeError, TypeError, ValueError, IRError):  # `b[k]` is not even of the right kind
            return False
    return True


def _find_cycle(edges: dict[str, tuple[str, ...]]) -> str | None:
    """A node on a cycle of the graph `edges` (depth-first search with colours), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for start in edges:
        if state.get(start):
            continue
        state[start] = 1
        stack = [(start, iter(edges[start]))]
        while stack:
            name, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[name] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return nxt
            elif not state.get(nxt) and nxt in edges:
                state[nxt] = 1
                stack.append((nxt, iter(edges[nxt])))
    return None


class _Scope:
    """What one function has defined so far, and which parameters `assign` consumed."""

    __slots__ = ("func", "defined", "params", "assigned", "checked")

    def __init__(self, f: Func):
        self.func = f
        self.params = set(f.params)
        self.defined: set[Value] = set(f.params)
        self.assigned: set[Value] = set()
        self.checked: set[TensorType] = set()  # unsharded result types already found valid here


def verify(module: Module) -> Module:
    """Check every rule of the spec's verification section; raise IRError on the first
    violation. Returns the module, so `verify(parse(text))` reads naturally."""
    c = _Checker(module)
    with gc_paused():
        for mesh in module.meshes.values():
            c.mesh(mesh)
        for f in module.funcs.values():
            c.func(f)
        c.calls()
        c.tasks()
    return module
