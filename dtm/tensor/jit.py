"""dtm.jit: trace a function to one IR module per input signature, and replay it."""

from __future__ import annotations

from typing import Callable

from ..errors import ErrorCode, user_error as error
from ..ir.module import Module
from ..runtime import execute
from ..runtime.mesh import Shards
from .core import STATE, Tensor, capture, no_grad

class _Traced:
    __slots__ = ("module", "n_args", "captured", "out_is_tuple")

    def __init__(self, module: Module, n_args: int, captured: list[Tensor], out_is_tuple: bool):
        self.module, self.n_args, self.captured, self.out_is_tuple = module, n_args, captured, out_is_tuple


class jit:  # noqa: N801 - reads as a decorator, like torch.jit / jax.jit
    """Trace `fn` to an IR module once per input signature and replay it.

    Tensor arguments become the function's parameters; tensors `fn` reads from outside
    (model weights) become further parameters whose current values are read at every
    call, so an optimizer's updates are seen. Other arguments are part of the signature.
    `jit(fn).ir(*args)` returns the traced module; with distributed tensors (dtm.parallel)
    it is the global view, and `ir(*args, view="local", rank=r)` rank r's partitioned
    program, with the collectives that run."""

    def __init__(self, fn: Callable, backend: str | None = None):
        self.fn = fn
        self.backend = backend
        self.cache: dict = {}

    def _signature(self, args) -> tuple:
        for a in args:
            if isinstance(a, Tensor) and a._mesh is not None:
                a.realize()  # its layout is part of the signature
        return tuple(("T", a.type, a._mesh, a._placements) if isinstance(a, Tensor) else ("V", repr(a))
                     for a in args)

    def _trace(self, args) -> _Traced:
        key = self._signature(args)
        traced = self.cache.get(key)
        if traced is not None:
            return traced
        placeholders = [Tensor(a.type) if isinstance(a, Tensor) else a for a in args]
        for p, a in zip(placeholders, args):
            if isinstance(a, Tensor):
                p._mesh, p._placements = a._mesh, a._placements
        STATE.tracing += 1
        try:
            with no_grad():
                out = self.fn(*placeholders)
        finally:
            STATE.tracing -= 1
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        tensor_args = [p for p in placeholders if isinstance(p, Tensor)]
        module, params = capture(outs, params=tensor_args, name=getattr(self.fn, "__name__", "main"))
        module.funcs["main"] = module.funcs.pop(next(iter(module.funcs)))
        module.funcs["main"].name = "main"
        traced = _Traced(module, len(tensor_args), params[len(tensor_args):], isinstance(out, (tuple, list)))
        self.cache[key] = traced
        return traced

    def ir(self, *args, view: str = "global", rank: int = 0) -> Module:
        traced = self._trace(args)
        if view == "global":
            return traced.module
        if view != "local":
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"jit.ir: view is \"global\" or \"local\", not {view!r}")
        return execute.local_view(traced.module, "main", rank)

    def __call__(self, *args):
        traced = self._trace(args)
        tensors = [a for a in args if isinstance(a, Tensor)] + traced.captured
        results = execute.run(traced.module, "main", [t.realize()._buffer for t in tensors], self.backend)
        outs = [Tensor(t, buffer=r) if type(r) is Shards else Tensor.from_numpy(r)
                for (t, _), r in zip(traced.module.funcs["main"].result_types, results)]
        return tuple(outs) if traced.out_is_tuple else outs[0]
