"""The lazy Tensor, and the walk from recorded ops to a run: `apply` records an op (its
type checked at once), `capture` turns the pending nodes into one IR function, `realize`
hands it to the runtime, `backward` differentiates it as IR. Grad mode and the tracing
state of dtm.jit live here too (STATE).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Sequence

import numpy as np

from ..compiler.autodiff import grad
from ..compiler.spmd import FREE, propagate_shardings, resolve_free
from ..errors import ErrorCode, user_error as error
from ..ir import DType
from ..ir.attrs import normalize_attrs
from ..ir.dtypes import from_numpy as dtype_of_numpy, numpy_dtype
from ..ir.module import Func, Module, Op, Value
from ..ir.registry import REGISTRY
from ..ir.typerules import TypeRuleError
from ..ir.types import TensorType
from ..runtime import execute
from ..runtime.mesh import DeviceMesh, Shards
from . import dlpack, dynamic, versions
from .dtypes import DEFAULT_FLOAT, _combine, bool_, float32, int64, promote_types
from ..errors import TensorTypeError, user_line

# --- grad mode and tracing ----------------------------------------------------------------

class Trace:
    """What dtm.jit records while it traces a function, besides the ops themselves."""

    def __init__(self, placeholders: Sequence["Tensor"]):
        self.placeholders = {id(p) for p in placeholders}  # the traced function's arguments
        self.effects: list[tuple[Tensor, Tensor]] = []  # (a leaf, its new value): the program's `assign`s
        self.updated: set[int] = set()                   # the leaves assigned so far
        self.hooks: list[Callable[[], None]] = []        # Python bookkeeping to redo before each replay
        self.graded: dict[int, Tensor] = {}              # leaves whose .grad a traced backward() set
        # checks of argument values to make on each call, before the program runs
        # (functional._checked): (the arguments and known tensors the checked value is
        # computed from, the module computing it from them or None when it is the one
        # argument itself, error code, fault(values) -> message or None, the traced op's line)
        self.checks: list[tuple[list[Tensor], Module | None, Any, Callable[[np.ndarray], str | None],
                                str | None]] = []


class _State(threading.local):
    grad_enabled = True
    tracing = 0
    trace: Trace | None = None  # the dtm.jit trace being recorded on this thread
    meshes: dict = {}  # the IR meshes collectives may name: an enclosing shard_map's


STATE = _State()


class _GradMode:
    """A context manager (and decorator) that sets grad mode inside and restores it after;
    `enabled` is the mode inside, None to leave it as it is."""

    enabled: bool | None = False

    def __new__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):  # a bare decorator: @dtm.no_grad
            return cls()(args[0])
        return super().__new__(cls)

    def __enter__(self):
        self.prev = STATE.grad_enabled
        if self.enabled is not None:
            STATE.grad_enabled = self.enabled

    def __exit__(self, *exc):
        STATE.grad_enabled = self.prev

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            with self._fresh():
                return fn(*a, **kw)
        return wrapped

    def _fresh(self) -> "_GradMode":
        """A new manager of the same mode: each call of a decorated function keeps its own `prev`."""
        fresh = object.__new__(type(self))
        fresh.enabled = self.enabled
        return fresh


class no_grad(_GradMode):  # noqa: N801 - torch's name
    """Ops inside record no gradient history (usable as a decorator too)."""

    enabled = False


class enable_grad(_GradMode):  # noqa: N801 - torch's name
    """Ops inside record gradient history, even within no_grad (usable as a decorator too)."""

    enabled = True


class inference_mode(_GradMode):  # noqa: N801 - torch's name
    """torch.inference_mode: no gradient history inside (mode=False: grad mode unchanged).
    DTM needs no version counters to be fast (tensor/versions.py checks saved values only
    at backward()), so this is no_grad by another name."""

    def __init__(self, mode: bool = True):
        self.enabled = False if mode else None


def is_grad_enabled() -> bool:
    return STATE.grad_enabled


def weak_append(refs: list | None, obj: Any) -> list:
    """`refs` (a new list when None) with a weak reference to obj appended; the dead ones
    are dropped whenever the list reaches a power of two, so it stays short."""
    if refs is None:
        refs = []
    refs.append(weakref.ref(obj))
    if len(refs) >= 16 and not len(refs) & (len(refs) - 1):
        refs[:] = [r for r in refs if r() is not None]
    return refs


# --- the Tensor ---------------------------------------------------------------------------

class Tensor:
    """A lazy n-dimensional array of IR type `_type` (dtype and shape; `type()` is torch's
    method, tensor/extra_ops.py). `_op` is None for a leaf (data, or a jit placeholder
    when `_buffer` is None too); otherwise the tensor is the result of `_op` applied to
    `_inputs` with `_attrs`, computed once into `_buffer` by realize().

    A distributed tensor (dtm.parallel) has a `_mesh` (a DeviceMesh), taken from its inputs
    or its value (a `Shards`), and `_placements`: its value's layout once realized, else the
    layout the user pinned with redistribute (None: propagation decides).

    The methods below are the Tensor's own; its operators and op methods (`+`, `@`, `[]`,
    `sum`, `reshape`, `softmax`, ...) are the functions of functional.py, attached from the
    one table at its end (`_METHODS`)."""

    __slots__ = ("_type", "_op", "_inputs", "_attrs", "_buffer", "requires_grad", "grad", "_users", "_mesh",
                 "_placements", "_freed", "_view", "_views", "_saves", "_written", "__weakref__")
    __array_priority__ = 1000  # numpy defers to our operators: ndarray + Tensor -> Tensor

    def __init__(self, type: TensorType, op: str | None = None, inputs: tuple["Tensor", ...] = (),
                 attrs: dict | None = None, buffer: np.ndarray | None = None, requires_grad: bool = False):
        self._type = type
        self._op = op
        self._inputs = inputs
        self._attrs = attrs if attrs is not None else {}
        self._buffer = buffer
        self.requires_grad = requires_grad
        self.grad: Tensor | None = None
        self._users: list[weakref.ref] | None = None  # ops that read this tensor, see _snapshot
        self._mesh, self._placements = None, None
        self._freed = False  # a backward() went through it and freed its graph (retain_graph=False)
        # views (tensor/inplace.py): (root base, base -> this, writable) for a view; a base's views
        self._view: tuple | None = None
        self._views: list[weakref.ref] | None = None
        # torch's version counter (tensor/versions.py): what the gradient of `_op` reads, when
        # not its op's row; on a snapshot, what in-place op replaced the value
        self._saves: tuple | None = None
        self._written: tuple | None = None
        if isinstance(buffer, Shards):  # (`type` is the TensorType here)
            self._mesh, self._placements = buffer.mesh, buffer.placements
        for t in inputs:
            t._add_user(self)
            if t._mesh is not None:
                self._mesh = t._mesh

    def _add_user(self, user: "Tensor") -> None:
        self._users = weak_append(self._users, user)

    def _snapshot(self, op: str = "an in-place update") -> "Tensor":
        """A new tensor with this one's current value and history, which the ops that have
        read this tensor so far now read instead. An in-place write (x[i] = v) then changes
        only what later ops see, as in torch, where the earlier ops would have run already.
        The snapshot remembers `op`, the write, at the user's line: backward() refuses it
        where an op saved it for its gradient, as torch does (tensor/versions.py); and a
        leaf's points to the leaf, whose .grad its gradient goes to."""
        old = Tensor(self._type, self._op, self._inputs, self._attrs, self._buffer, self.requires_grad)
        old._mesh, old._placements, old._freed, old._saves = self._mesh, self._placements, self._freed, self._saves
        for ref in self._users or ():
            u = ref()
            if u is not None and u._inputs:  # realized results without history read nothing again
                u._inputs = tuple(old if i is self else i for i in u._inputs)
                old._add_user(u)
        if old._users:
            line = user_line()
            old._written = (self if self._op is None else None, f"{op} at {line}" if line else op, False)
        self._users = None
        return old

    def _set_value(self, array: np.ndarray, op: str = "an update of its value (an optimizer's step, a load)") -> None:
        """Give this tensor a new value in place, as a leaf (an optimizer step,
        load_state_dict): ops recorded earlier keep reading the old value. A distributed
        tensor given a whole array keeps its layout: the array is split over its mesh."""
        self._snapshot(op)
        self._saves = None
        if type(array) is not Shards and self._mesh is not None:
            array = self._mesh.split(np.asarray(array), self._placements)
        self._buffer, self._op, self._inputs, self._attrs = array, None, (), {}
        self._mesh, self._placements = (array.mesh, array.placements) if type(array) is Shards else (None, None)
        if self._views:  # its views (w.T) show the new value, as torch's views of a stepped weight do
            VIEW_HOOKS[0](self, op)

    # -- construction --
    @staticmethod
    def from_numpy(array: np.ndarray, requires_grad: bool = False) -> "Tensor":
        arr = np.asarray(array)
        try:
            dtype = dtype_of_numpy(arr.dtype)
        except KeyError:
            raise error(ErrorCode.UNKNOWN_DTYPE, f"numpy dtype {arr.dtype} has no DTM dtype") from None
        # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
        arr = arr if arr.flags.c_contiguous else np.array(arr, order="C")
        t = Tensor(TensorType(dtype, arr.shape), buffer=arr)
        if requires_grad:
            t.requires_grad_(True)
        return t

    def requires_grad_(self, flag: bool = True) -> "Tensor":
        if flag and not self.dtype.is_float:
            raise error(ErrorCode.DTYPE_MISMATCH, f"only float tensors can require grad, this one is {self.dtype}")
        self.requires_grad = flag
        return self

    # -- shape and dtype --
    @property
    def dtype(self) -> DType:
        return self._type.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._type.shape

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[normalize_dim(dim, self.ndim)]

    @property
    def ndim(self) -> int:
        return len(self._type.shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_leaf(self) -> bool:
        return self._op is None or not self.requires_grad

    @property
    def device(self) -> str:
        return "cpu"

    # -- running --
    def realize(self, backend: str | None = None) -> "Tensor":
        realize(self, backend=backend)
        return self

    def numpy(self) -> np.ndarray:
        self.realize()
        return self._buffer.numpy() if type(self._buffer) is Shards else self._buffer

    def item(self):
        if self.numel() != 1:
            raise error(ErrorCode.SHAPE_MISMATCH, f"item() needs a tensor with one element, this one is {self._type}")
        return self.numpy().reshape(()).item()

    def tolist(self):
        return self.numpy().tolist()

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a.astype(dtype) if dtype is not None else a

    def __dlpack__(self, *args, **kwargs):
        return dlpack.export(self.numpy(), *args, **kwargs)

    def __dlpack_device__(self):
        return self.numpy().__dlpack_device__()

    def __repr__(self) -> str:
        if STATE.tracing:
            return f"Tensor(<traced {self._type}>)"
        body = np.array2string(self.numpy(), separator=", ", prefix="tensor(")
        extra = f", dtype={self.dtype}" if self.dtype not in (float32, int64, bool_) else ""
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"tensor({body}{extra}{grad})"

    def __len__(self) -> int:
        if not self.shape:
            raise error(ErrorCode.RANK_MISMATCH, "len() of a 0-d tensor")
        return self.shape[0]

    def __bool__(self) -> bool:
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __index__(self) -> int:
        b = self._buffer
        if type(b) is np.ndarray and b.ndim == 0:  # (quick: an index read in a data loader's loop)
            return int(b)
        return int(self.item())

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    __hash__ = object.__hash__

    # -- autograd --
    def backward(self, gradient: "Tensor | None" = None, retain_graph: bool | None = None) -> None:
        """Accumulate d(self)/d(leaf) into `.grad` of every leaf that requires grad (a
        non-scalar tensor needs `gradient`, the seed), as torch.Tensor.backward does. The
        graph is freed afterwards: going through it again raises GRAPH_FREED unless this
        call passed retain_graph=True."""
        backward(self, gradient, retain_graph=bool(retain_graph))

    def detach(self) -> "Tensor":
        """The same value with no gradient history."""
        if self._buffer is not None:
            return Tensor(self._type, buffer=self._buffer)
        t = Tensor(self._type, self._op, self._inputs, self._attrs)
        t._placements = self._placements
        return t

    def retain_grad(self) -> None:
        """Have backward() fill this non-leaf's .grad too, as torch's retain_grad does: the
        tensor becomes its own value plus a zero leaf that requires grad (a `_GradProbe`),
        whose gradient, d(loss)/d(self), lands in this tensor's .grad. Every use of the
        tensor goes through the sum, those recorded before too. A leaf: nothing to do."""
        if not self.requires_grad:
            raise error(ErrorCode.ATTRIBUTE_VALUE, "retain_grad(): this tensor does not require grad")
        if self._op is None or any(type(i) is _GradProbe for i in self._inputs):
            return
        same = Tensor(self._type, self._op, self._inputs, self._attrs, self._buffer, requires_grad=True)
        same._saves, self._saves = self._saves, None
        probe = _GradProbe(self)
        self._op, self._inputs, self._attrs = "add", (same, probe), {}
        same._add_user(self)
        probe._add_user(self)

    def __deepcopy__(self, memo: dict) -> "Tensor":
        """copy.deepcopy: a leaf of the same class (a Parameter stays one) with its own copy
        of the value, requires_grad and .grad; as in torch, only graph leaves copy."""
        if self._op is not None and self.requires_grad:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"deepcopy: only leaf tensors can be copied, this {self._type} is "
                        "computed by an op that records gradient history (copy its .detach())")
        self.realize()
        new = type(self).__new__(type(self))
        Tensor.__init__(new, self._type, buffer=_copy(self._buffer), requires_grad=self.requires_grad)
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)
        return new

    # -- distribution (dtm.distribute makes a distributed tensor) --
    @property
    def placements(self) -> tuple | None:
        """One placement per mesh axis of a distributed tensor (None for a plain one): its
        value's, the pinned ones, or (pending and unpinned) what propagation gives it."""
        if self._mesh is None:
            return None
        if self._placements is not None and FREE not in self._placements:
            return self._placements
        module, _ = capture([self])
        return propagate_shardings(module, "main").result_types[0][1].placements

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The mesh of a distributed tensor (None for a plain one)."""
        return self._mesh

    def redistribute(self, placements) -> "Tensor":
        """The same value laid out by `placements` on the same mesh (lazy; the partitioner
        picks the collectives, spec 2.9). Differentiable. With a {axis: placement} dict, the
        axes it does not name keep what propagation gives them."""
        if self._mesh is None:
            raise error(ErrorCode.INVALID_PLACEMENT, f"redistribute: {self._describe()} is not distributed; use "
                        "dtm.distribute(t, mesh, placements)")
        pl = self._mesh.placements(placements, self._type, f"redistribute({self._describe()})", rest=FREE)
        out = apply("reshape", self, shape=self.shape)
        out._placements = pl
        return out

    def full_tensor(self) -> "Tensor":
        """A plain tensor with the whole value (lazy and differentiable, like every op)."""
        if self._mesh is None:
            return self
        out = apply("reshape", self, shape=self.shape)
        out._mesh = out._placements = None
        return out

    def local_shards(self) -> list["Tensor | None"]:
        """Each mesh rank's piece, as plain tensors, in rank order. On a process mesh
        (runtime L1) a process holds only its own rank's piece: the others are None
        (full_tensor() or numpy() gathers the whole value, every rank calling it)."""
        return [Tensor.from_numpy(p) if p is not None else None for p in self._pieces()]

    def local_arrays(self) -> list[np.ndarray | None]:
        """`local_shards()` as read-only numpy arrays over the tensor's own memory (no copy,
        no Tensor around each): what a checkpoint or snapshot copies from, where wrapping
        each of a model's pieces in a Tensor cost as much as copying it."""
        out: list[np.ndarray | None] = []
        for p in self._pieces():
            if p is not None:
                p = p.view()
                p.setflags(write=False)
            out.append(p)
        return out

    def _pieces(self) -> list[np.ndarray | None]:
        """The realized value's arrays, one per mesh rank (None: another process holds it);
        a plain tensor's one array."""
        if self._buffer is None:  # (a snapshot reads every tensor of a state each step: no call when computed)
            self.realize()
        return self._buffer.pieces if type(self._buffer) is Shards else [self._buffer]

    def _describe(self) -> str:
        """"tensor f32[8, 4]", with the placements of a distributed tensor when known."""
        layout = f" {list(self._placements)}" if self._placements is not None else ""
        return f"tensor {self._type}{layout}"


class _GradProbe(Tensor):
    """The zero leaf retain_grad() adds to a tensor: its gradient is the tensor's, so its
    .grad is the tensor's .grad (backward() accumulates into it as into any leaf's)."""

    __slots__ = ("_target",)

    def __init__(self, target: Tensor):
        self._target = target  # first: Tensor.__init__ sets .grad
        super().__init__(target._type, buffer=np.zeros(target.shape, numpy_dtype(target.dtype)), requires_grad=True)

    @property
    def grad(self) -> Tensor | None:
        return self._target.grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        self._target.grad = value


# --- recording ops ------------------------------------------------------------------------

def normalize_dim(d: int, rank: int) -> int:
    """A torch-style dim (negative counts from the end; a 0-d tensor takes 0 or -1) as 0..rank-1."""
    r = max(rank, 1)
    if not -r <= d < r:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"dim {d} is out of range for a tensor of rank {rank} "
                    f"(expected {-r} <= dim < {r})")
    return d % r


def apply(op: str, /, *inputs: Tensor, type: TensorType | None = None, **attrs: Any) -> Tensor:
    """Record `op` on `inputs`: check it with the op's type rule now (errors name the
    user's line) and return the lazy result. (`op` is positional-only: collectives have an
    attribute named op.)"""
    opdef = REGISTRY[op]
    in_types = tuple(t._type for t in inputs)
    declared = (type,) if type is not None else ()
    try:
        norm = normalize_attrs(op, opdef.attr_index, attrs, type.dtype if type is not None else None)
        out = opdef.rule(op, in_types, norm, declared, _NO_MESHES)
        if type is None and any(a.kind.value == "scalar" for a in opdef.attrs):
            norm = normalize_attrs(op, opdef.attr_index, attrs, out[0].dtype)
    except TypeRuleError as e:
        raise error(e.code, e.message) from None
    placed = [(i, t) for i, t in enumerate(inputs) if t._mesh is not None]
    for i, t in placed[1:]:
        (j, first) = placed[0]
        if t._mesh != first._mesh:
            raise error(ErrorCode.MESH_MISMATCH, f"{op}: operand {j} ({first._type} {list(first._placements or ())}) "
                        f"is on {first._mesh}, operand {i} ({t._type} {list(t._placements or ())}) on {t._mesh}; "
                        "one op runs on one mesh: distribute both tensors on the same mesh")
    trace = STATE.trace
    if trace is not None and trace.updated and any(id(t) in trace.updated for t in inputs):
        raise error(ErrorCode.USE_AFTER_ASSIGN, f"{op}: in a dtm.jit-traced step, this reads a value after the step "
                    "updated it (an optimizer's step, say); read it before the update, or in the next call")
    requires = STATE.grad_enabled and any(t.requires_grad for t in inputs) and out[0].dtype.is_float
    return Tensor(out[0], op, inputs, norm, requires_grad=requires)


class _NoMeshes:
    """The context a type rule sees from eager code: no functions, and the meshes of an
    enclosing shard_map (none outside one)."""

    funcs: dict = {}

    @property
    def meshes(self) -> dict:
        return STATE.meshes


_NO_MESHES = _NoMeshes()


def _sharding(t: Tensor):
    """The sharding a captured value carries: a distributed tensor's realized or pinned layout."""
    return t._mesh.sharding(t._placements) if t._mesh is not None and t._placements is not None else None


class _Walk:
    """One post-order walk of the recorded graph below some outputs: the tensors to compute
    (`nodes`, each after its inputs), the leaves and realized tensors read (`found`, the
    parameters after the explicit ones), and `key`, the program's structure (ops,
    attributes, types, layouts, which value feeds which): equal keys give equal IR, so the
    IR built for a key, differentiated and compiled once, serves every later walk with it."""

    __slots__ = ("nodes", "found", "key", "mesh")

    def __init__(self, nodes: list, found: list, key: tuple, mesh):
        self.nodes, self.found, self.key, self.mesh = nodes, found, key, mesh


def _walk(outputs: Sequence[Tensor], params: Sequence[Tensor], keep: Callable[[Tensor], bool] | None,
          effects: Sequence[tuple[Tensor, Tensor]]) -> _Walk:
    pos: dict[int, int] = {id(t): i for i, t in enumerate(params)}
    key: list = [(t._type, t._mesh, t._placements) for t in params]
    nodes: list[Tensor] = []
    found: list[Tensor] = []
    mesh = next((t._mesh for t in params if t._mesh is not None), None)  # of distributed tensors
    placeholders = STATE.trace.placeholders if STATE.trace is not None else ()
    # Iterative post-order walk: programs can be far deeper than Python's recursion limit.
    roots = list(outputs) + [t for pair in effects for t in pair]
    stack: list[tuple[Tensor, bool]] = [(t, False) for t in reversed(roots)]
    while stack:
        t, ready = stack.pop()
        if id(t) in pos:
            continue
        if mesh is None and t._mesh is not None:
            mesh = t._mesh
        if t._op is None or (t._buffer is not None and not (keep and keep(t))):
            if t._op is None and t._buffer is None and id(t) not in placeholders:
                raise error(ErrorCode.UNDEFINED_VALUE, "a traced placeholder from another dtm.jit call was used here")
            pos[id(t)] = len(pos)
            found.append(t)
            key.append((t._type, t._mesh, t._placements))
            continue
        if not ready:
            stack.append((t, True))
            for i in reversed(t._inputs):
                if id(i) not in pos:
                    stack.append((i, False))
            continue
        pos[id(t)] = len(pos)
        nodes.append(t)
        key.append((t._op, t._type, tuple(pos[id(i)] for i in t._inputs), tuple(t._attrs.items()), t._placements))
    key.append(tuple(pos[id(t)] for t in outputs))
    key.append(tuple((pos[id(a)], pos[id(b)]) for a, b in effects))
    return _Walk(nodes, found, tuple(key), mesh)


def _build(w: _Walk, params: Sequence[Tensor], outputs: Sequence[Tensor], name: str,
           effects: Sequence[tuple[Tensor, Tensor]]) -> Module:
    """The IR function of a walk: parameters `params`, then the tensors found, numbered
    in the order found; one op per node; `effects` as `assign`s at the end."""
    index: dict[int, Value] = {}
    args = []
    for t in list(params) + w.found:
        v = index[id(t)] = Value(t._type, f"p{len(args)}", _sharding(t))
        args.append(v)
    ops: list[Op] = []
    for t in w.nodes:
        v = index[id(t)] = Value(t._type, f"t{len(ops)}", _sharding(t))
        ops.append(Op(t._op, tuple(index[id(i)] for i in t._inputs), t._attrs, (v,)))
    ops += [Op("assign", (index[id(target)], index[id(value)]), {}, ()) for target, value in effects]
    func = Func(name, args, [(t._type, None) for t in outputs], ops, [index[id(t)] for t in outputs])
    module = Module()
    module.funcs[name] = func
    if w.mesh is not None:  # the mesh the shardings name (one per program: the runtime checks)
        module.meshes[w.mesh.ir().name] = w.mesh.ir()
        resolve_free(module, name)  # axes a redistribute left open get what propagation gives
    return module


def capture(outputs: Sequence[Tensor], params: Sequence[Tensor] = (), name: str = "main",
            keep: Callable[[Tensor], bool] | None = None,
            effects: Sequence[tuple[Tensor, Tensor]] = ()) -> tuple[Module, list[Tensor]]:
    """The IR function computing `outputs`, and the tensors its parameters stand for.

    Parameters are `params` first (in order), then every other tensor the walk reaches that
    is a leaf or already realized (its buffer is read at run time). `keep(t)` may force a
    realized tensor to be recomputed from its inputs instead (autograd needs that).
    `effects` (leaf, value) become `assign`s at the end of the function: the leaf's buffer
    takes the value in place when the function runs."""
    w = _walk(outputs, params, keep, effects)
    return _build(w, params, outputs, name, effects), list(params) + w.found


# Programs built from a walk's structure, kept so that the next walk with the same key (the
# next eager training step, the next realize of the same computation) reuses the IR, its
# gradient function and, through the module object, its compiled plan: no rebuilding,
# differentiating or hashing. Least recently used first out.
_PROGRAMS: OrderedDict[tuple, Any] = OrderedDict()
_MAX_PROGRAMS = 64


def _program(kind: tuple, w: _Walk, make: Callable[[], Any]) -> Any:
    """The program `make()` built for a walk of this structure (kind: what was made)."""
    key = (kind, w.key)
    entry = _PROGRAMS.get(key)
    if entry is None:
        entry = _PROGRAMS[key] = make()
        while len(_PROGRAMS) > _MAX_PROGRAMS:
            _PROGRAMS.popitem(last=False)
    else:
        _PROGRAMS.move_to_end(key)
    return entry


def realize(*tensors: Tensor, backend: str | None = None) -> None:
    """Compute every pending tensor in `tensors` with one IR program. A view's base is
    computed with it, as torch's would have been: otherwise a loop that reads a view of
    what it appends to (`idx[:, -64:]` of `idx = cat(idx, next)`) keeps the base pending,
    and every program would recompute its whole history."""
    pending = []
    seen = set()
    for t in tensors:
        for u in (t, t._view[0]) if t._view is not None else (t,):
            if u._buffer is None and id(u) not in seen:
                seen.add(id(u))
                pending.append(u)
    if not pending:
        return
    if STATE.tracing:
        raise error(ErrorCode.UNDEFINED_VALUE, "a value cannot be read inside dtm.jit while tracing "
                    "(no .item(), .numpy(), print or if on tensors in a jitted function)")
    w = _walk(pending, (), None, ())
    if any(p._buffer is None for p in w.found):
        raise error(ErrorCode.UNDEFINED_VALUE, "this tensor depends on a dtm.jit placeholder and cannot be realized")
    module, _ = _program(("realize",), w, lambda: dynamic.program(_build(w, (), pending, "main", ()), "main", backend))
    results = execute.run(module, "main", [p._buffer for p in w.found], backend)
    for t, r in zip(pending, results):
        _take(t, r)
        if not t.requires_grad:
            t._inputs = ()  # nothing will differentiate through it: free the graph


def _take(t: Tensor, value) -> None:
    """Give pending tensor t its computed value: a distributed one keeps the pieces (and
    learns their layout); a plain one computed by a distributed program (full_tensor), the
    whole array."""
    if type(value) is Shards:
        if t._mesh is None:
            value = value.numpy()
        else:
            t._placements = value.placements
    t._buffer = value


# --- backward -----------------------------------------------------------------------------

def _frontier(root: Tensor) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Walk the graph of tensors that require grad: the leaves that require grad, the
    pending tensors that do not (computed first, so no gradient flows through them), and
    the intermediates between. A graph an earlier backward() freed is an error."""
    leaves, pending_consts, inner, seen = [], [], [], set()
    stack = [root]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if not t.requires_grad:
            if t._buffer is None:
                pending_consts.append(t)
            continue
        if t._op is None:
            leaves.append(t)
            continue
        if t._freed:
            raise error(ErrorCode.GRAPH_FREED, f"backward(): trying to go through the graph of a {t._type} a second "
                        "time; an earlier backward() freed it. Pass retain_graph=True to the first backward() "
                        "to go through it again, or compute the value anew")
        versions.check(t)  # a value its gradient reads, changed in place since: torch's error
        inner.append(t)
        stack.extend(t._inputs)
    return leaves, pending_consts, inner


def backward(loss: Tensor, gradient: Tensor | None = None, backend: str | None = None,
             retain_graph: bool = False) -> None:
    """Capture the program that computed `loss` as IR, differentiate it with the compiler's
    autodiff transform (so the backward pass is IR too, and fuses and shards like anything
    else), run both in one program and accumulate `.grad` on the leaves. On a mesh, each
    gradient is brought to its leaf's placements (an all_reduce for a replicated leaf of
    sharded data, a reduce_scatter for a sharded one) before the program is partitioned."""
    if not loss.requires_grad:
        raise error(ErrorCode.ATTRIBUTE_VALUE, "backward(): this tensor does not require grad "
                    "(no input has requires_grad=True, or it was computed under no_grad)")
    if gradient is None and loss.numel() != 1:
        raise error(ErrorCode.SHAPE_MISMATCH, f"backward(): a gradient is needed for a non-scalar output {loss._type}")
    if STATE.trace is not None:
        return _backward_traced(loss, gradient, retain_graph)
    _, consts, inner = _frontier(loss)
    realize(*consts)
    # Recompute requires-grad intermediates, so autodiff sees every op between leaves and loss.
    w = _walk([loss], (), _recomputed, ())
    params = w.found
    wrt = [i for i, p in enumerate(params) if p.requires_grad and p._op is None]
    inputs = [p._buffer for p in params]
    if gradient is not None:
        g = gradient if isinstance(gradient, Tensor) else Tensor.from_numpy(np.asarray(gradient))
        if g._type != loss._type:
            raise error(ErrorCode.SHAPE_MISMATCH, f"backward(): gradient is {g._type}, the output is {loss._type}")
        inputs.append(g.realize()._buffer)
    seed = "ones" if gradient is None else "param"
    module, name = _program(("grad", seed, tuple(wrt)), w,
                            lambda: dynamic.program(*_gradient_program(w, [loss], wrt, seed), backend))
    results = execute.run(module, name, inputs, backend)
    if loss._buffer is None:
        _take(loss, results[0])
    for i, g in zip(wrt, results[1:]):
        leaf = _live(params[i])
        if type(g) is not Shards:
            g = Tensor.from_numpy(g)
        else:
            g = Tensor(leaf._type, buffer=g) if leaf._mesh is not None else Tensor.from_numpy(g.numpy())
        if leaf.grad is None:
            leaf.grad = g
        elif type(leaf.grad._buffer) is np.ndarray and type(g._buffer) is np.ndarray:
            leaf.grad = Tensor.from_numpy(leaf.grad.numpy() + g._buffer)
        else:
            leaf.grad = (leaf.grad + g).realize()
    if not retain_graph:
        _free(inner)


def _recomputed(t: Tensor) -> bool:
    """What a backward pass recomputes from its inputs rather than reads: every op between
    the leaves and the loss, so autodiff sees them all."""
    return t.requires_grad and t._op is not None


def _gradient_program(w: _Walk, outputs: list[Tensor], wrt: list[int], seed: str) -> tuple[Module, str]:
    """The module of a walk with its gradient function (results: the outputs, then one
    gradient per parameter in `wrt`, each laid out like its parameter), and that function's name."""
    module = _build(w, (), outputs, "main", ())
    name = grad(module, "main", wrt, seed=seed)
    f = module.funcs[name]
    for k, i in enumerate(wrt, start=1):
        leaf = w.found[i]
        if leaf._mesh is not None:
            f.result_types[k] = (f.result_types[k][0], leaf._mesh.sharding(leaf.placements))
    return module, name


def _live(leaf: Tensor) -> Tensor:
    """The leaf whose .grad a gradient goes to: a snapshot of a leaf's value from before an
    in-place update stands for the leaf itself (torch's leaf stays one tensor)."""
    w = leaf._written
    return w[0] if w is not None and w[0] is not None else leaf


def _free(inner: list[Tensor]) -> None:
    """As torch frees the saved tensors of a graph after backward(): a second pass through
    these intermediates is an error (GRAPH_FREED), and a computed one drops its graph."""
    for t in inner:
        t._freed = True
        if t._buffer is not None:
            t._inputs = ()


def _backward_traced(loss: Tensor, gradient: Tensor | None, retain_graph: bool) -> None:
    """backward() inside dtm.jit: the gradient program is recorded, not run. The forward
    is captured and differentiated as in eager mode, and the differentiated function's ops
    are recorded as lazy tensors (its forward part repeats ops already recorded; the
    compiler's common-subexpression pass merges them), so the gradients, an optimizer's
    step on them and the forward become one traced program."""
    _, _, inner = _frontier(loss)
    module, params = capture([loss], keep=_recomputed)
    wrt = [i for i, p in enumerate(params) if p.requires_grad and p._op is None]
    args = list(params)
    if gradient is not None:
        g = gradient if isinstance(gradient, Tensor) else Tensor.from_numpy(np.asarray(gradient))
        if g._type != loss._type:
            raise error(ErrorCode.SHAPE_MISMATCH, f"backward(): gradient is {g._type}, the output is {loss._type}")
        args.append(g)
    name = grad(module, "main", wrt, seed="ones" if gradient is None else "param")
    results = record_func(module.funcs[name], args, mesh=module_mesh(module))
    for i, g in zip(wrt, results[1:]):
        leaf = _live(params[i])
        if leaf._mesh is not None:  # brought to its leaf's layout, as in eager mode
            g = g.redistribute(leaf.placements)
        leaf.grad = g if leaf.grad is None else leaf.grad + g
        STATE.trace.graded[id(leaf)] = leaf
    if not retain_graph:
        _free(inner)


def module_mesh(module: Module) -> DeviceMesh | None:
    """The mesh a captured module names (None: it names none)."""
    return DeviceMesh.of(next(iter(module.meshes.values()))) if module.meshes else None


def record_func(f: Func, args: Sequence[Tensor], history: bool = False,
                mesh: DeviceMesh | None = None) -> list[Tensor]:
    """Record the ops of IR function f on tensors `args` (one per parameter) as lazy
    tensors, without gradient history unless `history` (then a result requires grad where
    an operand does, in grad mode, as `apply` decides); f's results. (Every op has one
    result here: a differentiated function has no effects.) `mesh`: the mesh of f's
    module, for layouts pinned on values whose operands are on none (a dtm.jit
    placeholder that DDP shards by rows)."""
    env: dict[int, Tensor] = {id(v): t for v, t in zip(f.params, args)}
    history = history and STATE.grad_enabled
    for op in f.ops:
        (r,) = op.results
        ins = tuple(env[id(v)] for v in op.operands)
        requires = history and r.type.dtype.is_float and any(i.requires_grad for i in ins)
        t = Tensor(r.type, op.name, ins, op.attrs, requires_grad=requires)
        if r.sharding is not None and t._mesh is None and mesh is not None:
            t._mesh = mesh  # as `distribute` pins a placeholder: else that op of the copy is unplaced
        if r.sharding is not None and t._mesh is not None:  # a layout the user pinned
            t._placements = r.sharding.placements
        env[id(r)] = t
    return [env[id(v)] for v in f.returns]


# --- updating leaves: an optimizer's step ----------------------------------------------------

def assign(pairs: Sequence[tuple[Tensor, Tensor]]) -> None:
    """Give each target (a leaf that holds a value: a parameter, an optimizer's state) the
    value of its source, all computed in one program. Eagerly the targets take the new
    values (ops recorded before keep reading the old ones); inside dtm.jit the pairs become
    the traced program's `assign` effects, which write the targets' buffers in place on
    every call."""
    trace = STATE.trace
    for target, _ in pairs:
        if target._op is not None or target._buffer is None:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"assign: the target must be a leaf with a value, this "
                        f"{target._type} is computed by an op or is a dtm.jit placeholder")
    if trace is None:
        realize(*(v for _, v in pairs))
        for target, value in pairs:
            target._set_value(value._buffer)
        return
    for target, value in pairs:
        if id(target) in trace.updated:
            raise error(ErrorCode.USE_AFTER_ASSIGN, f"assign: a {target._type} is updated twice in one dtm.jit-traced "
                        "step")
        trace.effects.append((target, value))
        trace.updated.add(id(target))


def on_replay(hook: Callable[[], None]) -> None:
    """Inside dtm.jit, have `hook` run before each later call of the traced function: the
    Python bookkeeping that the traced ops depend on (an optimizer's step count and learning
    rate, written into the 0-d tensors the program reads). Outside a trace: nothing."""
    if STATE.trace is not None:
        STATE.trace.hooks.append(hook)


def prepare_in_place(targets: Sequence[Tensor]) -> None:
    """Before a program writes the buffers of `targets` in place: each becomes writable (a
    read-only buffer, from a loaded file say, is copied), and pending ops that read one
    keep its current value (a snapshot with a copy), as they would with an eager update."""
    for t in targets:
        if t._users and any(u() is not None and u()._buffer is None for u in t._users):
            old = t._snapshot("a dtm.jit step's update (assign)")
            old._buffer = _copy(t._buffer)
        if t._views:  # its views: computed anew from the buffer the program writes
            VIEW_HOOKS[0](t, "a dtm.jit step's update (assign)")
        if type(t._buffer) is Shards:
            if any(p is not None and not p.flags.writeable for p in t._buffer.pieces):
                t._buffer = _copy(t._buffer)
        elif not t._buffer.flags.writeable:
            t._buffer = t._buffer.copy()


# [views_changed(base, op)]: tensor/inplace.py's, which rebinds the live views of a base
# given a new value here (an optimizer's step, a load, a dtm.jit step's update)
VIEW_HOOKS: list[Callable[[Tensor, str], None]] = [lambda base, op: None]


def _copy(value):
    if type(value) is Shards:
        return Shards(value.mesh, value.placements, [p.copy() if p is not None else None for p in value.pieces])
    return value.copy()


# What may stand beside tensors as an operand: Python and numpy numbers, and array data.
_OPERANDS = (bool, int, float, np.bool_, np.integer, np.floating, np.ndarray, list, tuple)


def result_type(*xs: Any) -> DType:
    """PyTorch's promotion over tensors and Python scalars, in three tiers promoted apart:
    tensors with dims, rank-0 tensors, scalars (bool; int as i64; float as the default
    float). A lower tier only lifts the category of the ones above it, so int tensor + 2.5
    -> f32, f16 tensor + 2.5 -> f16, i32 tensor + i64 rank-0 tensor -> i32, but i32 tensor
    + f64 rank-0 tensor -> f64."""
    tiers: list[DType | None] = [None, None, None]
    for x in xs:
        if isinstance(x, Tensor):
            tier, d = (0 if x.ndim else 1), x.dtype
        elif not isinstance(x, _OPERANDS):  # a str, None, a complex: numpy would fail later, deep inside
            raise TensorTypeError(ErrorCode.DTYPE_MISMATCH, f"unsupported operand {x!r} of type {type(x).__name__}; "
                                  "expected a Tensor, a bool, int or float, or array data", user_line())
        else:
            tier = 2
            d = (bool_ if isinstance(x, (bool, np.bool_)) else
                 DEFAULT_FLOAT if isinstance(x, (float, np.floating)) else int64)
        tiers[tier] = d if tiers[tier] is None else promote_types(tiers[tier], d)
    return _combine(tiers[0], _combine(tiers[1], tiers[2]))
