"""The in-memory IR: a `Module` holds meshes, functions and task declarations; a `Func` is
one block of `Op`s in SSA form over `Value`s.

Values are compared by identity; their names are for people only (the canonical encoding
numbers them), so renaming `%x` changes neither `==` nor `hash()`. Module equality *is*
equality of canonical encodings.
"""

from __future__ import annotations

import hashlib
from typing import Any

from .encoding import encode
from .printer import format as format_module
from .types import Mesh, Sharding, TensorType

Loc = tuple[int, int]  # (line, col), 1-based; None for IR built from Python


class Value:
    """An SSA value: its TensorType, an optional Sharding, and a name for people only
    (compared by identity; the canonical encoding numbers values)."""

    __slots__ = ("name", "type", "sharding")

    def __init__(self, type: TensorType, name: str | None = None, sharding: Sharding | None = None):
        self.type = type
        self.name = name
        self.sharding = sharding

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}" + (f" {self.sharding}" if self.sharding else "")


class AttrsKey:
    """A hashable stand-in for an op's attributes, hashed once, so type rules can be
    memoised on it cheaply; ops parsed from the same text share one."""

    __slots__ = ("items", "_hash")

    def __init__(self, attrs: dict[str, Any]):
        self.items = tuple(sorted(attrs.items()))
        self._hash = hash(self.items)

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, AttrsKey) and self._hash == other._hash and self.items == other.items)

    def __hash__(self) -> int:
        return self._hash


class Op:
    """One operation. `attrs` holds every attribute, defaults filled in, values immutable."""

    __slots__ = ("name", "operands", "attrs", "results", "loc", "attrs_key")

    def __init__(self, name: str, operands: tuple[Value, ...], attrs: dict[str, Any],
                 results: tuple[Value, ...], loc: Loc | None = None, attrs_key: AttrsKey | None = None):
        self.name = name
        self.operands = operands
        self.attrs = attrs
        self.results = results
        self.loc = loc
        self.attrs_key = attrs_key if attrs_key is not None else AttrsKey(attrs)

    def __repr__(self) -> str:
        return f"<Op {self.name} at {self.loc}>"


class Func:
    """A function: its parameters (Values), result types ((TensorType, Sharding or None)
    pairs), one block of ops, and the Values it returns."""

    __slots__ = ("name", "params", "result_types", "ops", "returns", "loc", "return_loc")

    def __init__(self, name: str, params: list[Value], result_types: list[tuple[TensorType, Sharding | None]],
                 ops: list[Op] | None = None, returns: list[Value] | None = None,
                 loc: Loc | None = None, return_loc: Loc | None = None):
        self.name = name
        self.params = params
        self.result_types = result_types
        self.ops = ops if ops is not None else []
        self.returns = returns if returns is not None else []
        self.loc = loc
        self.return_loc = return_loc


class Task:
    """A task-graph node: run `func` on the store keys `inputs`, write its results to the
    store keys `outputs`, after the tasks named in `after` have finished."""

    __slots__ = ("name", "func", "inputs", "outputs", "after", "loc")

    def __init__(self, name: str, func: str, inputs: tuple[str, ...], outputs: tuple[str, ...],
                 after: tuple[str, ...] = (), loc: Loc | None = None):
        self.name = name
        self.func = func
        self.inputs = inputs
        self.outputs = outputs
        self.after = after
        self.loc = loc


class Module:
    """An IR module: its meshes, functions and tasks by name, and its version (None for one
    built in code). Modules are equal when their canonical encodings are; `.hash()` is the
    hex sha256 of that encoding (the object itself is mutable, so not hashable)."""

    __slots__ = ("version", "meshes", "funcs", "tasks")

    def __init__(self, version: tuple[int, int] | None = None):
        # None (a module built in code): written as the lowest version its ops need
        # (versioning.lowest), so that a module of 1.0 ops reads on every 1.x reader and
        # keeps its hash; a parsed module keeps its header's version
        self.version: tuple[int, int] | None = version
        self.meshes: dict[str, Mesh] = {}
        self.funcs: dict[str, Func] = {}
        self.tasks: dict[str, Task] = {}

    def hash(self) -> str:
        """Hex sha256 of the canonical encoding."""
        return hashlib.sha256(encode(self)).hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Module) and encode(self) == encode(other)

    __hash__ = None  # mutable

    def __str__(self) -> str:
        return format_module(self)
