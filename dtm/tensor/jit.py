"""dtm.jit: trace a function once per input signature into one IR module, and replay it.

    @dtm.jit
    def step(x, y):                       # a whole training step, as one program
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        dtm.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    for x, y in batches:
        loss = step(x, y)                 # traced on the first call, replayed after

Tracing runs `fn` once on placeholders of its tensor arguments (with the caller's grad
mode). Tensors it reads from outside (weights, optimizer state) become further parameters
whose current values are read at every call. `backward()` records the gradient program
instead of running it, and an optimizer's `step()` records its updates as the program's
`assign` effects: each call then writes the new weights and state into their buffers in
place, and runs the Python bookkeeping the traced ops depend on (step counts, the learning
rate a scheduler set) before it starts. Gradients still held when the function returns (no
`zero_grad()` after the step) come back as `.grad` of their parameters after each call.
Random draws (dropout) take their key as a parameter drawn afresh before each call, so
every call draws new numbers, the ones the eager call would have drawn.
The checks eager ops make on values they know (indices in range, integer divisors not
zero: spec 3.6 `gather`) are made on each call, before the program runs, for the arguments
that reach such an operand directly or through a small computation of arguments and known
tensors (`pos + arange(T)`: evaluated by the reference interpreter), so a bad batch raises
as it would eagerly; other computed operands are checked inside the program (the `check`
op, spec 3.15).

As with torch.jit.trace and tinygrad's TinyJit, Python control flow is frozen at the trace:
the signature (argument types and layouts, other arguments' values) picks a trace, and
nothing in `fn` may read a tensor's value (`.item()`, `print`, `if` on a tensor).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import ErrorCode, user_error as error
from ..ir.module import Module
from ..runtime import execute
from ..ref import run as ref_run
from ..runtime.mesh import Shards, generation as mesh_generation
from . import autocast, dynamic
from .core import STATE, Tensor, Trace, capture, prepare_in_place, realize


def value_fault(value: np.ndarray | Shards, fault: Callable[[np.ndarray], str | None]) -> str | None:
    """What `fault` finds in a tensor's value (each piece of a distributed one), or None."""
    for piece in (value.pieces if type(value) is Shards else (value,)):
        message = piece is not None and fault(piece)
        if message:
            return message
    return None


class _Traced:
    """One trace: the module, and what a call binds to it and from it."""

    __slots__ = ("module", "n_args", "captured", "out_is_tuple", "n_out", "graded", "targets", "hooks", "checks",
                 "result_types", "runs")

    def __init__(self, module: Module, n_args: int, captured: list[Tensor], out_is_tuple: bool, n_out: int,
                 graded: list[Tensor], targets: list[Tensor], hooks: list[Callable[[], None]],
                 checks: list[tuple[list, Module | None, Any, Callable[[np.ndarray], str | None], str | None]]):
        self.module, self.n_args, self.captured, self.out_is_tuple = module, n_args, captured, out_is_tuple
        self.n_out, self.graded, self.targets, self.hooks = n_out, graded, targets, hooks
        self.checks = checks  # as Trace.checks, an argument's position in place of its placeholder
        self.result_types = [(t, t.is_static) for t, _ in module.funcs["main"].result_types]
        self.runs: Module | None = None  # what calls run: the trace, or its family's symbolic function


class jit:  # noqa: N801 - reads as a decorator, like torch.jit / jax.jit
    """Trace `fn` to an IR module once per input signature and replay it (see the module
    docstring). `jit(fn).ir(*args)` returns the module traced for these arguments; with distributed tensors
    (dtm.parallel) it is the global view, and `ir(*args, view="local", rank=r)` rank r's
    partitioned program, with the collectives that run.

    `donate`: positions among the tensor arguments whose values the caller gives up at each
    call (a KV cache replaced by its update): a result computed from one by
    dynamic_update_slice may then be written into its memory, and come back as the same
    array. A donated tensor must not be used after the call.

    `dynamic`: as torch.compile's. By default (None) a function is traced for each new
    signature, but once a second set of sizes was seen its traces share one symbolic program,
    compiled once (dtm.tensor.dynamic): a training loop over many sequence lengths compiles
    twice. False compiles every signature's own program."""

    def __init__(self, fn: Callable, backend: str | None = None, donate: tuple[int, ...] = (),
                 dynamic: bool | None = None):
        self.fn = fn
        self.backend = backend
        self.donate = frozenset(donate)  # positions among the tensor arguments the caller gives up
        self.dynamic = dynamic
        self.cache: dict = {}

    def _signature(self, args) -> tuple:
        for a in args:
            if isinstance(a, Tensor) and a._mesh is not None:
                a.realize()  # its layout is part of the signature
        return tuple(("T", a._type, a._mesh, a._placements) if isinstance(a, Tensor) else ("V", repr(a))
                     for a in args) + ((("autocast", autocast.current()),) if autocast.current() is not None else ()) \
            + (("meshes", mesh_generation()),)  # a resized process mesh: the captured weights' shards changed

    def _trace(self, args) -> tuple[_Traced, bool]:
        """The trace for these arguments, and whether it was made just now."""
        key = self._signature(args)
        traced = self.cache.get(key)
        if traced is not None:
            return traced, False
        # a process mesh resized since: the traces of its old shapes can never be called again
        self.cache = {k: t for k, t in self.cache.items() if k[-1] == key[-1]}
        placeholders = [Tensor(a._type) if isinstance(a, Tensor) else a for a in args]
        tensor_args = [p for p in placeholders if isinstance(p, Tensor)]
        for p, a in zip(placeholders, args):
            if isinstance(a, Tensor):
                p._mesh, p._placements = a._mesh, a._placements
        # f32 too: the weights a step reads are most often captured, not arguments
        execute.prepare({"f32"} | {p._type.dtype.name for p in tensor_args}, self.backend)
        trace = Trace(tensor_args)
        prev = STATE.trace
        STATE.tracing += 1
        STATE.trace = trace
        try:
            out = self.fn(*placeholders)
        finally:
            STATE.tracing -= 1
            STATE.trace = prev
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if not all(isinstance(o, Tensor) for o in outs):
            raise error(ErrorCode.RETURN_MISMATCH, f"dtm.jit: {getattr(self.fn, '__name__', 'the function')} must "
                        f"return tensors (or a tuple of them), found {out!r}")
        graded = [t for t in trace.graded.values() if t.grad is not None and t.grad._buffer is None]
        module, params = capture(outs + [t.grad for t in graded], params=tensor_args,
                                 name=getattr(self.fn, "__name__", "main"), effects=trace.effects)
        module.funcs["main"] = module.funcs.pop(next(iter(module.funcs)))
        module.funcs["main"].name = "main"
        position = {id(p): k for k, p in enumerate(tensor_args)}
        checks = [([position.get(id(t), t) for t in sources], derive, code, fault, line)
                  for sources, derive, code, fault, line in trace.checks]
        traced = _Traced(module, len(tensor_args), params[len(tensor_args):], isinstance(out, (tuple, list)),
                         len(outs), graded, [target for target, _ in trace.effects], trace.hooks, checks)
        self.cache[key] = traced
        return traced, True

    def ir(self, *args, view: str = "global", rank: int = 0) -> Module:
        traced, _ = self._trace(args)
        if view == "global":
            return traced.module
        if view != "local":
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"jit.ir: view is \"global\" or \"local\", not {view!r}")
        return execute.local_view(traced.module, "main", rank)

    def __call__(self, *args) -> Any:
        traced, values = self._bind(args)
        results = execute.run(traced.runs, "main", values, self.backend, donated=self.donate)
        return self._outputs(traced, results)

    def _bind(self, args: tuple) -> tuple[_Traced, list]:
        """The trace for `args` and the values its program reads, checked."""
        traced, fresh = self._trace(args)
        if not fresh:  # (the trace itself did this call's bookkeeping)
            for hook in traced.hooks:
                hook()
        tensors = [a for a in args if isinstance(a, Tensor)] + traced.captured
        realize(*tensors)  # pending arguments (clipped gradients, say) as one program
        for sources, derive, code, fault, line in traced.checks:  # what eager ops check on known values
            values = [(tensors[k] if type(k) is int else k)._buffer for k in sources]
            message = value_fault(values[0] if derive is None else ref_run(derive, "main", values)[0], fault)
            if message:
                raise error(code, f"{message}, in the op traced at {line}")
        prepare_in_place(traced.targets)
        if traced.runs is None:  # (at the first call, not the trace: `ir()` compiles nothing)
            traced.runs = traced.module if self.dynamic is False else \
                dynamic.program(traced.module, "main", self.backend)[0]
        return traced, [t._buffer for t in tensors]

    def _outputs(self, traced: _Traced, results: list) -> Any:
        # a result of a static type is wrapped as it is (from_numpy would find the type again:
        # a decoding step's 25 results took 0.2 ms of a 24 ms token that way)
        outs = [Tensor(t, buffer=r) if type(r) is Shards or (static and type(r) is np.ndarray and r.flags.c_contiguous)
                else Tensor.from_numpy(r) for (t, static), r in zip(traced.result_types, results)]
        for leaf, g in zip(traced.graded, outs[traced.n_out:]):
            leaf.grad = g
        outs = outs[:traced.n_out]
        return tuple(outs) if traced.out_is_tuple else outs[0]

    def _repeat(self, times: int, args: tuple, feed: tuple[int, int], advance: tuple[int, int],
                stop: tuple[np.ndarray, int, np.ndarray] | None = None):
        """The function called `times` times as one compiled loop (execute.repeat): after
        each call its result feed[0] becomes its tensor argument feed[1], and its int64
        scalar argument advance[0] grows by advance[1]; both arguments' arrays are written
        in place. `stop`: (eos ids, pad id, alive rows), as Plan.repeat takes them. Returns
        the last call's results and result feed[0] of each call, stacked [calls, ...]; None,
        calling nothing, where the backend cannot (the caller then calls it itself). The
        values of arguments that eager ops would check (an embedding's ids) are checked
        once, before the first call: what is fed back is the caller's to keep in range (a
        greedy step's argmax is)."""
        traced, _ = self._trace(args)
        if traced.graded or traced.targets or traced.hooks:
            return None
        traced, values = self._bind(args)
        got = execute.repeat(traced.runs, "main", values, times, feed, advance, self.backend, donated=self.donate,
                             stop=stop)
        return None if got is None else (self._outputs(traced, got[0]), got[1])
