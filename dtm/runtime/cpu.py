"""The `cpu` backend: DTM IR compiled into fused C kernels (dtm.compiler), run on numpy buffers.

    from dtm.runtime.backend import get_backend
    outs = get_backend("cpu").run(module, "main", [x, w])

A function is compiled once per module (the plan is cached in memory by the module object,
and by its hash for an equal module built again) and kernels once per source (on disk, see
dtm/backends/cpu/build.py). A plan serves every shape of a symbolic function: the symbols are bound
from the input shapes at each run and handed to the kernels as arguments.

Each run allocates the temporaries' memory slots and the returned arrays, then runs the
steps in order: compiled steps (kernels, and the move steps of gather / dynamic_slice /
dynamic_update_slice) through the runtime's launch loop, each run of consecutive ones from
one ctypes call (`dtm_run_steps`, dtm/backends/cpu/c_move.py; the GIL is released while they run), and
fallback kernels through the reference implementation (dtm.ref.ops.IMPLS) for the ops the
compiler does not lower. Inputs are used as given (an `assign` writes into the caller's
array, as with the reference); no returned array shares memory with an input, except a
donated one (`run(..., donated=)`: a KV cache updated in place is returned as itself).

DTM_DEBUG=1 prints each kernel's name and time as it runs; DTM_DEBUG=2 also prints the C
source of each kernel when the plan is built; DTM_DEBUG=passes prints every pass's output.
A plan reads DTM_DEBUG when it is built (reading the environment costs a small run 10%).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from itertools import compress
from operator import is_not, itemgetter
from typing import Callable, Iterable, Sequence

import numpy as np

from ..backends.cpu import build as B
from ..backends.cpu.c_move import KIND as _INDEX_KIND
from ..backends.cpu.passes import compile_func
from ..compiler.irutil import debug_flags
from ..compiler.program import Buffer, FallbackStep, KernelStep, MoveStep, Program, writes_into
from ..errors import DTMError, ErrorCode as E
from ..ir.module import Module
from ..ir.symbolic import SymDim
from ..ir.types import TensorType
from ..ref import philox, quant
from ..ref.collectives import collective_into
from ..ref.context import RefContext
from ..ref.interpreter import bind_symbols, check_array, evaluate, out_of_memory, resolve_attrs, resolve_type
from ..ref.ops import IMPLS, TAKES_IN_TYPES, scatter_add_into
from . import buffers
from .abandon import abandoned, stand_in
from .host import check_free

_EMPTY = np.zeros(64, np.uint8)  # backs every empty buffer: a kernel may read its element 0
_EMPTY_PTR = _EMPTY.ctypes.data
_NO_IDS = np.zeros(0, np.int64)  # Plan.repeat without eos ids
STATS = {"plans": 0}
_RUNTIME_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}  # the runtime library's types


def _debug_level() -> int:
    flags = debug_flags()
    return 2 if "2" in flags else 1 if "1" in flags else 0


def _ptr(a: np.ndarray) -> int:
    """The address of a's first element (a contiguous array): through the buffer protocol, 3x
    cheaper than __array_interface__, which builds a dict (1.2 us, a tenth of a small
    product's plan.run); a read-only array, which exports no writable buffer, the slow way."""
    if not a.size:
        return _EMPTY_PTR
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.__array_interface__["data"][0]


def _changed(now: Sequence, before: Sequence) -> Iterable[int]:
    """The positions where `now` holds another object than `before` (all of them when the
    lengths differ), found at C speed: a decoding step binds 176 arrays, 174 of them the same
    weights and caches as at the step before, and looking at each in Python took a tenth of
    a millisecond of a 24 ms token."""
    if len(now) != len(before):
        return range(len(now))
    return compress(range(len(now)), map(is_not, now, before))


def _picker(indices: list[int]) -> Callable[[list], tuple]:
    """A function giving the tuple of a list's items at `indices`, in one C call."""
    if len(indices) == 1:
        i = indices[0]
        return lambda values: (values[i],)
    return itemgetter(*indices) if indices else lambda values: ()


def _contiguous(x: np.ndarray) -> np.ndarray:
    return x if x.flags.c_contiguous else np.array(x, order="C")  # keeps 0-d arrays 0-d


class _Kernel:
    """A loaded compiled step (a kernel, or a move step run by the runtime's C): its
    function, where each argument comes from, and its int64 arguments: a kernel's symbol
    values (`dims`, positions in the plan's symbols, or literals of its own: share.py), a
    move's geometry (`_move_args`)."""

    __slots__ = ("step", "fn", "args", "dims", "name", "index", "move", "address")

    def __init__(self, index: int, step: KernelStep | MoveStep, symbols: list[str], fn, buf_index: dict):
        self.index = index
        self.step = step
        self.name = step.name
        self.fn = fn
        self.move = type(step) is MoveStep
        bufs = step.outputs + step.inputs if self.move else step.args
        self.args = [buf_index[id(b)] for b in bufs]
        # per dim: (position in the plan's symbols, 0), or (None, its value in this kernel)
        self.dims = [] if self.move else [(None, step.kernel.consts[d]) if d in step.kernel.consts
                                          else (symbols.index(d), 0) for d in step.kernel.dims]

    def int_args(self, values: list, bindings: dict) -> list[int]:
        return _move_args(self.step, bindings) if self.move else [v if j is None else values[j] for j, v in self.dims]


class _Frame:
    """The memory of one thread's runs at one set of symbol values: the slots, a view per
    temporary, and per kernel its pointer and dim arrays with the temporaries filled in.
    Runs on one thread reuse it; temporaries never leave a run (results are fresh arrays)."""

    __slots__ = ("key", "slots", "base", "ptrs", "dims", "fill", "launch", "run_alloc", "run_fill", "held", "kept")

    def __init__(self, plan: "Plan", bindings: dict, key):
        prog = plan.program
        self.key = key
        plan.check_memory(bindings)
        self.slots = [buffers.empty(max(int(evaluate(n, bindings)), 64), np.uint8) for n in prog.slots]
        self.base: list = [None] * len(plan.buffers)
        for i, b in enumerate(plan.buffers):
            if b.kind == "const":
                self.base[i] = _contiguous(b.data)
            elif b.kind == "temp" and not (b.alias is not None and b.alias.kind == "param"):
                self.base[i] = plan.allocate(b, bindings, self.slots)
        values = [bindings.get(s, 0) for s in plan.symbols]
        self.ptrs, self.dims, self.fill = [], [], []
        for k in plan.kernels:
            ptrs = (ctypes.c_void_p * max(len(k.args), 1))()
            fill = []
            for n, bi in enumerate(k.args):
                a = self.base[bi]
                if a is not None:
                    ptrs[n] = _ptr(a)
                else:
                    fill.append((n, bi))
            self.ptrs.append(ptrs)
            self.fill.append(fill)
            ints = k.int_args(values, bindings)
            self.dims.append((ctypes.c_int64 * max(len(ints), 1))(*ints))
        # per run of consecutive compiled steps: the arrays to allocate before it (buffer, the
        # (shape, dtype) of the fresh array or None, and its places among the pointers to fill:
        # neither a parameter nor a value a kernel writes into one, nor in a slot), the pointers
        # to fill, as ((pointer array, position) each, what picks their arrays from a run's
        # values), and the arrays dtm_run_steps reads. `held` the arrays the pointers were last
        # filled with, which are still there: the weights and a decoding step's donated caches,
        # the same arrays at every call, are not looked at again. A fresh array is not held (a
        # result the caller drops is freed)
        fills = [[(self.ptrs[k.index], n, bi) for k in run for n, bi in self.fill[k.index]] for run in plan.runs]
        is_param = [b.kind == "param" or i in plan.written_params for i, b in enumerate(plan.buffers)]
        self.run_alloc = [[(bi, plan.array_spec(plan.buffers[bi], bindings), [j for j, (_, _, b) in enumerate(f) if b == bi])
                           for bi in dict.fromkeys(bi for _, _, bi in f if not is_param[bi])] for f in fills]
        self.run_fill = [([(ptrs, n) for ptrs, n, _ in f], _picker([bi for _, _, bi in f])) for f in fills]
        self.held: list[tuple] = [() for _ in fills]
        # the arrays all_reduces between processes write their results into, by buffer,
        # kept from run to run (Plan.reused_results)
        self.kept: dict[int, np.ndarray] = {}
        self.launch = []
        for run in plan.runs:
            n = len(run)
            self.launch.append((ctypes.c_int64(n), (ctypes.c_void_p * n)(*[k.address for k in run]),
                                (ctypes.c_void_p * n)(*[ctypes.addressof(self.ptrs[k.index]) for k in run]),
                                (ctypes.c_void_p * n)(*[ctypes.addressof(self.dims[k.index]) for k in run])))


class Plan:
    """A compiled function: its program, the loaded kernels, and the run loop."""

    def __init__(self, module: Module, func: str, program: Program):
        self.module = module
        self.func = module.funcs[func]
        self.program = program
        self.symbols = program.symbols
        self.buffers = list(program.buffers)
        buf_index = {id(b): i for i, b in enumerate(self.buffers)}
        steps = program.kernels
        if _debug_level() >= 2:
            for step in steps:
                print(f"--- kernel {step.name}\n{step.kernel}\n{step.source}", file=sys.stderr)
        fns = B.load_functions([s.cfunc for s in steps], [s.name for s in steps])
        compiled = [s for s in program.steps if isinstance(s, (KernelStep, MoveStep))]
        by_kernel = {id(s): fn for s, fn in zip(steps, fns)}
        moves = B.runtime_library("move") if program.moves else None
        self.kernels = [_Kernel(i, st, self.symbols, by_kernel[id(st)] if type(st) is KernelStep
                                else _move_function(moves, st.op.name), buf_index)
                        for i, st in enumerate(compiled)]
        by_step = {id(k.step): k for k in self.kernels}
        self.steps = [by_step.get(id(s), s) for s in program.steps]
        # consecutive compiled steps run from one call of the runtime's loop (dtm_run_steps):
        # `schedule` holds, in order, a run (its number) or a fallback step, with the numbers
        # of the steps it covers
        self.runs, schedule = [], []
        self.done_in_place = program.done_in_place
        for i, step in enumerate(self.steps):
            if schedule and id(step) in self.done_in_place:  # an assign its value's kernel did: nothing
                schedule[-1][1].append(i)                    # to run, the run around it not split
                continue
            if type(step) is _Kernel:
                step.address = ctypes.cast(step.fn, ctypes.c_void_p).value
                if schedule and type(schedule[-1][0]) is int:
                    self.runs[schedule[-1][0]].append(step)
                    schedule[-1][1].append(i)
                else:
                    schedule.append((len(self.runs), [i]))
                    self.runs.append([step])
            else:
                schedule.append((step, [i]))
        # called with ctypes objects only (_Frame.launch), so without argtypes to convert
        # them: 1.1 us a call instead of 1.5
        self._launch = B.runtime_library("move").dtm_run_steps if self.runs else None
        self._repeat = B.runtime_library("move").dtm_run_steps_repeat if self.runs else None
        if self._launch is not None:
            self._launch.restype, self._repeat.restype = None, ctypes.c_int64
        self.frees = [[buf_index[id(b)] for b in f] for f in program.frees] if program.frees else \
            [[] for _ in program.steps]
        self.fb_args = {id(s): ([buf_index[id(b)] for b in s.inputs], [buf_index[id(b)] for b in s.outputs])
                        for s in program.fallbacks}
        # assign steps (an optimizer's updates: a few per parameter) run as one copy each, not
        # through the general fallback: (target buffer, value buffer) by step
        self.assigns = {id(s): tuple(self.fb_args[id(s)][0]) for s in program.fallbacks if s.op.name == "assign"}
        # scatter_adds write into the memory the plan gave their result (memory.plan_memory)
        self.into = {id(s) for s in program.fallbacks if writes_into(s.op)}
        # all_reduces whose result the plan alone holds (not returned, no other buffer its
        # view): a comm that takes `out` (between processes: a DDP step's gradient buckets)
        # writes it into an array the frame keeps, the same one at every run. A fresh result
        # each run cost as much again as the all_reduce itself: its pages faulted in anew.
        # (A step's gradients are all alive at its end, so its peak is the same; between
        # steps the frame holds their bytes, as it holds its slots, until `release`.)
        viewed = {id(b.alias) for b in self.buffers if b.alias is not None} | {id(b) for b in program.returns}
        self.reused_results = {id(s): buf_index[id(s.outputs[0])] for s in program.fallbacks
                               if s.op.name == "all_reduce" and id(s.outputs[0]) not in viewed}
        # the values a kernel writes straight into their parameter (plan_memory): (value, parameter)
        self.in_place = [(buf_index[id(b)], buf_index[id(b.alias)]) for b in self.buffers
                         if b.alias is not None and b.alias.kind == "param"]
        self.written_params = {value for value, _ in self.in_place}  # their arrays are the parameters'
        # dynamic_update_slices that may write over their operand when the caller donates it
        # (run): (input position, operand buffer, result buffer)
        last_read: dict[int, int] = {}
        for i, st in enumerate(program.steps):
            for b in st.inputs:
                last_read[id(b)] = i
        returned = {id(b) for b in program.returns}
        self.donatable = [(x.index, buf_index[id(x)], buf_index[id(out)])
                          for i, st in enumerate(program.steps)
                          if isinstance(st, MoveStep) and st.op.name == "dynamic_update_slice"
                          for x, out in [(st.inputs[0], st.outputs[0])]
                          if x.kind == "param" and out.kind == "output" and last_read[id(x)] == i
                          and id(x) not in returned and x not in st.inputs[1:]
                          and not any(o.alias is x for o in self.buffers)]
        self.params = [(buf_index[id(b)], b.index) for b in self.buffers if b.kind == "param"]
        self.returns = [(buf_index[id(b)], b.kind) for b in program.returns]
        self.symbolic = bool(self.symbols)
        self.static_types = [(quant.storage_shape(p.type), _np_dtype(p.type)) if p.type.is_static else None
                             for p in self.func.params]
        self.checks = [op for op in self.func.ops if op.name == "slice"
                       and any(isinstance(d, SymDim) for d in (*op.attrs["start"], *op.attrs["stop"]))]
        # per schedule entry, the buffers made by fallbacks whose last use its steps hold (freed after it)
        self.schedule = [(what, [bi for i in order for bi in self.frees[i] if self.buffers[bi].kind == "fallback"])
                         for what, order in schedule]
        self.debug = _debug_level()  # DTM_DEBUG as it was when the plan was built
        self._tls = threading.local()

    def release(self) -> None:
        """Drop what runs keep between calls, on every thread: the frames' memory and the
        last inputs checked (a step's weights and optimizer state). The next run allocates
        them anew; the compiled kernels stay."""
        self._tls = threading.local()

    @property
    def kernel_count(self) -> int:
        """Kernels a run launches: compiled ones and fallbacks."""
        return len(self.program.steps)

    # -- inputs --
    def _bind(self, inputs: list) -> dict:
        f = self.func
        if len(inputs) != len(f.params):
            raise DTMError(E.OPERAND_COUNT, f"@{f.name} takes {len(f.params)} input(s), found {len(inputs)}")
        # an array checked at the last call is the same array now (`checked` keeps it alive),
        # its shape and dtype changed only by assigning them, in place, over the same bytes
        types = self.static_types
        for i in _changed(inputs, getattr(self._tls, "checked", ())):
            x, t = inputs[i], types[i]
            if t is None or x.shape != t[0] or x.dtype != t[1]:  # a symbolic type, or a mismatch
                self._check_inputs(inputs)
                break
        if not self.symbolic:
            self._tls.checked = inputs
            return {}
        bindings = bind_symbols(f, inputs)
        for i, (p, x) in enumerate(zip(f.params, inputs)):
            check_array(x, resolve_type(p.type, bindings), f"@{f.name} input {i} (%{p.name})")
        for op in self.checks:
            _check_slice(op, bindings)
        return bindings

    def _check_inputs(self, inputs: list) -> None:
        f = self.func
        for i, (p, x, t) in enumerate(zip(f.params, inputs, self.static_types)):
            check_array(x, p.type, f"@{f.name} input {i} (%{p.name})", shape=False)
            if t is not None:
                check_array(x, p.type, f"@{f.name} input {i} (%{p.name})")

    def _frame(self, bindings: dict) -> _Frame:
        key = tuple([bindings.get(s, 0) for s in self.symbols]) if self.symbolic else ()
        frame = getattr(self._tls, "frame", None)
        if frame is None or frame.key != key:
            frame = self._tls.frame = _Frame(self, bindings, key)
        return frame

    # -- running --
    def run(self, inputs: Sequence[np.ndarray], ctx: RefContext | None = None,
            donated: frozenset = frozenset()) -> list[np.ndarray]:
        """The function's results on `inputs`. `donated`: positions of inputs the caller gives
        up: a dynamic_update_slice whose operand is such an input, read by nothing after it,
        writes its window into the input's own array, which it returns as its result (a KV
        cache updated in place); the caller must not use what it donated afterwards."""
        inputs, bindings, frame, vals, originals = self._values(inputs, donated)
        if self.debug:
            self._run_steps(frame, vals, originals, bindings, ctx)
        else:
            for what, freed in self.schedule:
                if type(what) is int:  # a run of compiled steps, launched by one call
                    self._fill(frame, vals, what, bindings)
                    self._launch(*frame.launch[what])
                else:
                    ctx = self._other(what, vals, originals, bindings, ctx, frame)
                    if abandoned():  # a collective lost a peer in an elastic step: the rest is never used
                        break
                for bi in freed:
                    vals[bi] = None
        if abandoned():
            return self._stand_ins(bindings)
        return self._results(inputs, frame, vals, originals)

    def _stand_ins(self, bindings: dict) -> list[np.ndarray]:
        """The results of a run given up (runtime.abandon): each of its type, NaN (zeros for
        integers, booleans and quantized blocks), as a lost peer's collective gives."""
        return [stand_in(*self._storage(self.buffers[bi], bindings)) for bi, _ in self.returns]

    def repeat(self, inputs: Sequence[np.ndarray], times: int, feed: tuple[int, int], advance: tuple[int, int],
               donated: frozenset = frozenset(),
               stop: tuple[np.ndarray, int, np.ndarray] | None = None) -> tuple[list[np.ndarray], np.ndarray] | None:
        """The function run `times` times by one call of the runtime (dtm_run_steps_repeat):
        after each run, result feed[0] is copied into input feed[1] (a decoding step's next
        ids), and the int64 scalar input advance[0] grows by advance[1] (its position); both
        inputs are arrays the caller owns, written in place. `stop` = (eos ids, pad id, alive
        flags, a uint8 a row, updated in place): result feed[0], int64 ids one a row, gets
        the pad id in rows no longer alive, a row that produced an eos id is alive no more,
        and the runs stop when no row is. Returns the last run's results and result feed[0]
        of every run, stacked [runs, ...]. None, running nothing, when the plan is more than
        one run of compiled steps or those inputs do not fit."""
        if len(self.schedule) != 1 or type(self.schedule[0][0]) is not int or self.in_place or self.debug:
            return None
        out_bi, kind = self.returns[feed[0]]
        into, count = inputs[feed[1]], inputs[advance[0]]
        owned = (into, count) if stop is None else (into, count, stop[0], stop[2])
        if kind != "output" or not all(type(a) is np.ndarray and a.flags.c_contiguous and a.flags.writeable
                                       for a in owned) or count.dtype != np.int64 or count.shape != ():
            return None
        inputs, bindings, frame, vals, originals = self._values(inputs, donated)
        what = self.schedule[0][0]
        self._fill(frame, vals, what, bindings)
        out = vals[out_bi]
        if out.dtype != into.dtype or out.shape != into.shape or any(
                x is into or x is count for i, x in enumerate(inputs) if i not in (feed[1], advance[0])):
            return None
        if stop is not None and (out.dtype != np.int64 or stop[0].dtype != np.int64 or stop[2].dtype != np.uint8
                                 or stop[2].size != out.size or not stop[0].size):
            return None
        eos, pad, alive = stop if stop is not None else (_NO_IDS, 0, _EMPTY)
        record = np.empty((times, *out.shape), out.dtype)
        ran = self._repeat(ctypes.c_int64(times), *frame.launch[what], ctypes.c_void_p(_ptr(out)),
                           ctypes.c_void_p(_ptr(into)), ctypes.c_int64(out.nbytes), ctypes.c_void_p(_ptr(record)),
                           ctypes.c_void_p(_ptr(count)), ctypes.c_int64(advance[1]), ctypes.c_void_p(_ptr(eos)),
                           ctypes.c_int64(eos.size), ctypes.c_int64(pad),
                           ctypes.c_void_p(_ptr(alive)))
        return self._results(inputs, frame, vals, originals), record[:ran]

    def _values(self, inputs: Sequence[np.ndarray], donated: frozenset) -> tuple[list, dict, _Frame, list, dict]:
        """A run's inputs as arrays, its symbol bindings, frame, values by buffer (the
        parameters', the donated inputs' results) and the parameters' arrays as given."""
        inputs = [x if type(x) is np.ndarray else np.asarray(x) for x in inputs]
        bindings = self._bind(inputs)
        frame = self._frame(bindings)
        vals = list(frame.base)
        originals: dict[int, np.ndarray] = {}
        for bi, pi in self.params:
            x = inputs[pi]
            originals[bi] = x
            vals[bi] = _contiguous(x)
        for value, target in self.in_place:  # the kernel computing the value writes the parameter
            if not originals[target].flags.writeable:
                raise DTMError(E.READ_ONLY_INPUT, f"@{self.func.name}: assign: the input array bound to the target "
                               "is read-only; pass a writable array the caller owns")
            vals[value] = vals[target]
        if donated and self.donatable:
            self._donate(inputs, donated, originals, vals)
        return inputs, bindings, frame, vals, originals

    def _fill(self, frame: _Frame, vals: list, what: int, bindings: dict) -> None:
        """Before run `what` of compiled steps: its fresh arrays allocated, and the pointers
        whose arrays changed since its last launch filled in."""
        fresh = []
        try:
            for bi, spec, places in frame.run_alloc[what]:
                if vals[bi] is None:
                    vals[bi] = np.empty(*spec) if spec else self.allocate(self.buffers[bi], bindings, None)
                    fresh += places
        except MemoryError:  # memory freed when the frame was made (check_memory) and taken since
            t = self.buffers[bi].type
            raise out_of_memory(f"@{self.func.name}", [resolve_type(t, bindings) if bindings else t]) from None
        entries, pick = frame.run_fill[what]
        arrays, last = pick(vals), None
        for j in _changed(arrays, frame.held[what]):
            if arrays[j] is not last:  # (a step's position is read by 36 of its kernels)
                last = arrays[j]
                address = _ptr(last)
            ptrs, n = entries[j]
            ptrs[n] = address
        if fresh:
            arrays = list(arrays)
            for j in fresh:
                arrays[j] = None
        frame.held[what] = arrays

    def _donate(self, inputs: list, donated: frozenset, originals: dict, vals: list) -> None:
        """Results written in place of donated inputs (see run): only an array this run may
        write (writable, its own memory, no other input a view of it)."""
        wanted = {id(originals[xb]): 0 for position, xb, _ in self.donatable if position in donated}
        for a in inputs:  # how often each is an input, or the base of one
            if id(a) in wanted:
                wanted[id(a)] += 1
            if a.base is not None and id(a.base) in wanted:
                wanted[id(a.base)] += 1
        for position, xb, ob in self.donatable:
            x = originals[xb]
            if position in donated and vals[xb] is x and x.flags.writeable and x.base is None \
                    and wanted[id(x)] == 1:
                vals[ob] = x

    def _other(self, step, vals: list, originals: dict, bindings: dict, ctx, frame: _Frame):
        """A step that is not compiled: an assign, a scatter_add, an all_reduce into a kept
        array, a reference fallback."""
        if id(step) in self.assigns:
            if id(step) not in self.done_in_place:
                target, value = self.assigns[id(step)]
                self._assign(step, originals.get(target, vals[target]), vals[value])
        elif id(step) in self.into:
            self._scatter_add(step, vals, bindings)
        elif id(step) in self.reused_results and getattr(getattr(ctx, "comm", None), "takes_out", False):
            self._all_reduce_into(step, vals, bindings, ctx, frame)
        else:
            ctx = self._fallback(step, vals, originals, bindings, ctx)
        return ctx

    def _run_steps(self, frame: _Frame, vals: list, originals: dict, bindings: dict, ctx) -> None:
        """The steps one by one, each timed (DTM_DEBUG), until the run is abandoned."""
        for i, step in enumerate(self.steps):
            t0 = time.perf_counter()
            if type(step) is _Kernel:
                ptrs = frame.ptrs[step.index]
                for n, bi in frame.fill[step.index]:
                    a = vals[bi]
                    if a is None:
                        a = vals[bi] = self.allocate(self.buffers[bi], bindings, None)
                    ptrs[n] = _ptr(a)
                step.fn(ptrs, frame.dims[step.index])
            else:
                ctx = self._other(step, vals, originals, bindings, ctx, frame)
            print(f"[dtm cpu] {step.name}: {(time.perf_counter() - t0) * 1e3:.3f} ms", file=sys.stderr)
            if abandoned():
                return
            for bi in self.frees[i]:
                if self.buffers[bi].kind == "fallback":
                    vals[bi] = None

    def _results(self, inputs: list, frame: _Frame, vals: list, originals: dict) -> list[np.ndarray]:
        for _, target in self.in_place:  # a parameter passed as a copy (not contiguous) gets its update
            if vals[target] is not originals[target]:
                np.copyto(originals[target], vals[target])
        results = []
        for bi, kind in self.returns:
            x = vals[bi] if kind != "param" else originals[bi]
            if kind in ("param", "const") or (kind == "fallback" and self._shares(x, inputs, frame)):
                x = x.copy()
            results.append(x)
        return results

    @staticmethod
    def _shares(x: np.ndarray, inputs: list, frame: _Frame) -> bool:
        return any(np.may_share_memory(x, a) for a in inputs) or any(np.may_share_memory(x, s) for s in frame.slots)

    @staticmethod
    def _storage(b: Buffer, bindings: dict) -> tuple[tuple, np.dtype]:
        """The shape and numpy dtype of buffer `b`'s array at these symbol values."""
        t = resolve_type(b.type, bindings) if bindings else b.type
        return tuple(int(d) for d in quant.storage_shape(t)), _np_dtype(t)

    def check_memory(self, bindings: dict) -> None:
        """Refuse a frame whose memory the machine does not have free, before any of it is
        allocated (host.check_free): its slots, and the temporaries outside them and the
        results a run allocates. The error names the largest value, most often the one the
        program was asked for (a product of 10^12 elements)."""
        values = [b for b in self.buffers if b.kind in ("temp", "output")]
        if not values:
            return
        storage = [self._storage(b, bindings) for b in values]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in storage]
        nbytes = sum(int(evaluate(n, bindings)) for n in self.program.slots)
        nbytes += sum(n for b, n in zip(values, sizes) if b.slot is None and b.alias is None)
        largest = values[sizes.index(max(sizes))]
        t = resolve_type(largest.type, bindings) if bindings else largest.type
        check_free(nbytes, f"@{self.func.name} (its largest value {t})")

    def array_spec(self, b: Buffer, bindings: dict) -> tuple | None:
        """(shape, dtype) of a fresh array for buffer `b` at these symbol values: what a run
        allocates for an output, known once per frame; None for an empty one (allocate)."""
        if b.kind == "param":
            return None
        shape, dtype = self._storage(b, bindings)
        return (shape, dtype) if math.prod(shape) else None

    def allocate(self, b: Buffer, bindings: dict, slots: list | None) -> np.ndarray:
        shape, dtype = self._storage(b, bindings)
        n = math.prod(shape)
        if b.slot is not None and slots is not None:
            return slots[b.slot][: n * dtype.itemsize].view(dtype).reshape(shape)
        if n == 0:
            return np.empty(1, dtype)[:0].reshape(shape)
        return np.empty(shape, dtype)

    def _assign(self, step: FallbackStep, target: np.ndarray, value: np.ndarray) -> None:
        """`assign`: the value into the caller's own array for the target, in place (the
        reference's implementation, called without the general fallback's preparations)."""
        try:
            IMPLS["assign"](None, {}, target, value, out_types=())
        except DTMError as e:
            raise DTMError(e.code, f"@{self.func.name} op assign ({step.name}): {e.message}") from e

    def _scatter_add(self, step: FallbackStep, vals: list, bindings: dict) -> None:
        """scatter_add into its planned result: x copied in unless the result is x's own
        memory (x's last use), then the updates added there."""
        ins, (out,) = self.fb_args[id(step)]
        x, indices, updates = (vals[i] for i in ins)
        result = vals[out]
        if result is None:  # a returned value: a fresh array the caller will own
            result = vals[out] = self.allocate(self.buffers[out], bindings, None)
        if _ptr(result) != _ptr(x):
            np.copyto(result, x)
        axis = step.op.attrs["axis"]
        dtype = _RUNTIME_DTYPES.get(result.dtype)
        if dtype is None or not updates.flags.c_contiguous or indices.dtype == np.uint64:  # (u64 > 2^63 clamps high)
            scatter_add_into(result, indices, updates, axis)
            return
        idx = np.ascontiguousarray(indices, np.int64)
        shape = result.shape
        fn = getattr(B.runtime_library(dtype), f"dtm_rt_scatter_add_{dtype}")
        fn(ctypes.c_int64(math.prod(shape[:axis])), ctypes.c_int64(shape[axis]),
           ctypes.c_int64(math.prod(shape[axis + 1:])), ctypes.c_void_p(_ptr(result)), ctypes.c_int64(idx.size),
           ctypes.c_void_p(_ptr(idx)), ctypes.c_void_p(_ptr(updates)))

    def _all_reduce_into(self, step: FallbackStep, vals: list, bindings: dict, ctx: RefContext, frame: _Frame) -> None:
        """An all_reduce between processes into the array the frame keeps for its result."""
        (x,), (bi,) = self.fb_args[id(step)]
        shape, dtype = self._storage(self.buffers[bi], bindings)
        out = frame.kept.get(bi)
        if out is None or out.shape != shape or out.dtype != dtype:
            out = frame.kept[bi] = buffers.empty(shape, dtype)
        attrs = resolve_attrs(step.op.attrs, bindings) if bindings else step.op.attrs
        try:
            vals[bi] = _contiguous(collective_into(ctx, "all_reduce", attrs, vals[x], out))
        except DTMError as e:
            raise e.in_context(f"@{self.func.name} op all_reduce ({step.name})") from e

    def _fallback(self, step: FallbackStep, vals: list, originals: dict, bindings: dict,
                  ctx: RefContext | None) -> RefContext:
        if ctx is None:
            ctx = RefContext()
        if ctx.module is None:
            ctx.module = self.module
        if not ctx.meshes:
            ctx.meshes = dict(self.module.meshes)
        op = step.op
        ins, outs_i = self.fb_args[id(step)]
        args = [originals.get(bi, vals[bi]) for bi in ins]  # assign writes into the caller's own array
        out_types = tuple(resolve_type(r.type, bindings) for r in op.results) if bindings else \
            tuple(r.type for r in op.results)
        attrs = resolve_attrs(op.attrs, bindings) if bindings else op.attrs
        kw = {"in_types": tuple(resolve_type(v.type, bindings) for v in op.operands)} \
            if op.name in TAKES_IN_TYPES else {}
        impl = _normal_draws if op.name == "random" and attrs["distribution"] == "normal" else IMPLS[op.name]
        try:
            with np.errstate(all="ignore"):
                outs = impl(ctx, attrs, *args, out_types=out_types, **kw)
        except DTMError as e:
            raise e.in_context(f"@{self.func.name} op {op.name} ({step.name})") from e
        except MemoryError:
            raise out_of_memory(f"@{self.func.name} op {op.name} ({step.name})", out_types) from None
        for bi, x in zip(outs_i, outs):
            x = np.asarray(x)
            if any(np.may_share_memory(x, a) for a in args):
                x = x.copy()  # a view of an operand: the operand's memory may be reused or assigned
            vals[bi] = _contiguous(x)
        return ctx


def _move_function(lib, op: str):
    fn = getattr(lib, f"dtm_move_{op}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = None
    return fn


def _row_bytes(dtype, trailing: tuple) -> int:
    """Bytes of one element along an axis: the dims after it (a quantized value's rows are
    whole blocks, spec 2.2)."""
    if dtype.is_quant:
        *lead, k = trailing
        return math.prod(lead) * (k // dtype.block) * dtype.itemsize
    return math.prod(trailing) * quant.storage_dtype(dtype).itemsize


def _move_args(step: MoveStep, bindings: dict) -> list[int]:
    """A move step's geometry at these symbol values (c_move.py): outer, the axis's size, the
    indices' count (or the window), the bytes per element along the axis, the index kind."""
    op = step.op
    types = [resolve_type(v.type, bindings) if bindings else v.type for v in op.operands]
    x, axis = types[0], op.attrs["axis"]
    shape = tuple(int(d) for d in x.shape)
    outer, d, width = math.prod(shape[:axis]), shape[axis], _row_bytes(x.dtype, shape[axis + 1:])
    if op.name == "gather":
        return [outer, d, math.prod(int(n) for n in types[1].shape), width, _INDEX_KIND[types[1].dtype.name]]
    if op.name == "dynamic_slice":
        size = int(resolve_attrs(op.attrs, bindings)["size"] if bindings else op.attrs["size"])
        if size > d:
            raise DTMError(E.ATTRIBUTE_VALUE, f"dynamic_slice: size {size} does not fit dim {axis} of size {d}")
        return [outer, d, size, width, _INDEX_KIND[types[1].dtype.name]]
    u = int(types[1].shape[axis])
    if u > d:
        raise DTMError(E.SHAPE_MISMATCH, f"dynamic_update_slice: the update has {u} elements along dim "
                       f"{axis}, the operand only {d}")
    return [outer, d, u, width, _INDEX_KIND[types[2].dtype.name]]


def _np_dtype(t: TensorType) -> np.dtype:
    return quant.storage_dtype(t.dtype)


def _normal_draws(ctx, attrs, key, *, out_types):
    """The `random` op's normal draws as the reference makes them (dtm.ref.philox.normal),
    its Philox words computed in C (c_random.WORDS): the same bits, 4x sooner (GPT-2 124M's
    initial weights in 4 s instead of 17)."""
    t = out_types[0]
    return (philox.normal(key, tuple(t.shape), _np_dtype(t), words=_philox_words),)


def _philox_words(key, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    x0, x1 = np.empty(n, np.uint64), np.empty(n, np.uint64)
    B.runtime_library("move").dtm_rt_philox_words(
        ctypes.c_uint32(int(key[0]) & 0xFFFFFFFF), ctypes.c_uint32(int(key[1]) & 0xFFFFFFFF), ctypes.c_uint64(start),
        ctypes.c_int64(n), ctypes.c_void_p(_ptr(x0)), ctypes.c_void_p(_ptr(x1)))
    return x0, x1


def _check_slice(op, bindings: dict) -> None:
    shape = resolve_type(op.operands[0].type, bindings).shape
    a = resolve_attrs(op.attrs, bindings)
    for i, (lo, hi, d) in enumerate(zip(a["start"], a["stop"], shape)):
        if not 0 <= lo <= hi <= d:
            raise DTMError(E.ATTRIBUTE_VALUE, f"slice: dim {i} of size {d} needs 0 <= start <= stop <= {d}, "
                           f"found {lo}:{hi}")


class ModuleHashes:
    """Module hashes memoised by module object (the last `size` modules seen, each kept
    alive by its entry), so a module run again is not encoded and hashed again. A module
    must not change after it is first hashed here (captured modules never do)."""

    def __init__(self, size: int = 256):
        self.size = size
        self._by_id: OrderedDict[int, tuple[Module, str]] = OrderedDict()

    def __call__(self, module: Module) -> str:
        entry = self._by_id.get(id(module))
        if entry is None or entry[0] is not module:
            entry = self._by_id[id(module)] = (module, module.hash())
            while len(self._by_id) > self.size:
                self._by_id.popitem(last=False)
        else:
            self._by_id.move_to_end(id(module))
        return entry[1]


class PlanCache:
    """Compiled plans by module: the last modules seen (by object, with their hash) and the
    last `size` functions (by module hash), least recently used dropped first. One thread
    compiles a function while others asking for it wait; `make(module, func)` builds the
    plan (the cpu backend's Plan, or an executor's subclass of it)."""

    def __init__(self, make: Callable[[Module, str], Plan], size: int = 512):
        self.make, self.size = make, size
        self._lock = threading.Lock()
        self._key = ModuleHashes()
        self._plans: OrderedDict[tuple[str, str], Plan] = OrderedDict()
        self._building: dict[tuple[str, str], threading.Lock] = {}

    def release(self) -> None:
        """Every cached plan's memory between runs (Plan.release); the plans stay."""
        with self._lock:
            plans = list(self._plans.values())
        for plan in plans:
            plan.release()

    def get(self, module: Module, func: str) -> Plan:
        """The compiled plan of `func` (compiled on first use, then cached)."""
        if func not in module.funcs:
            raise DTMError(E.UNDEFINED_FUNC, f"run: module has no function @{func} (it has: "
                           f"{', '.join('@' + n for n in module.funcs) or 'none'})")
        with self._lock:
            key = (self._key(module), func)
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
            building = self._building.setdefault(key, threading.Lock())
        with building:  # one thread compiles a function; others wait for it, not for every compile
            with self._lock:
                plan = self._plans.get(key)
            if plan is None:
                plan = self.make(module, func)
                with self._lock:
                    self._plans[key] = plan
                    while len(self._plans) > self.size:
                        self._plans.popitem(last=False)
                    self._building.pop(key, None)
                    STATS["plans"] += 1
        return plan


class CpuBackend:
    """Runs functions as compiled plans, cached by module (PlanCache)."""

    name = "cpu"

    def __init__(self):
        self.plans = PlanCache(lambda module, func: Plan(module, func, compile_func(module, func)))

    def prepare(self, dtypes: set[str]) -> None:
        """Start building the runtime libraries a program on tensors of `dtypes` will call
        (the launch loop; the products of f32 or f64) in the background, before its passes
        start them: a trace (and its autodiff) takes a quarter of a second of the first step
        of a training step, one core's, and the f32 library 0.8 s of the C compiler's."""
        B.prebuild_runtime({d for d in dtypes if d in _RUNTIME_DTYPES.values()} | {"move"})

    def plan(self, module: Module, func: str) -> Plan:
        """The compiled plan of `func` (compiled on first use, then cached)."""
        return self.plans.get(module, func)

    def run(self, module: Module, func: str, inputs: Sequence[np.ndarray],
            donated: frozenset = frozenset()) -> list[np.ndarray]:
        """`donated`: positions of inputs the caller gives up (Plan.run)."""
        return self.plans.get(module, func).run(inputs, donated=donated)


# The OpenMP runtimes kernels link: GCC's (-fopenmp, dtm/toolchain), else LLVM's (CC=clang).
_OPENMP_LIBRARIES = ("libgomp.so.1", "libomp.so")


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime library the kernels use (loaded once; the process shares it with
    every kernel by its name), or None when neither is installed."""
    for name in _OPENMP_LIBRARIES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def set_num_threads(n: int) -> None:
    """torch.set_num_threads: the cpu backend's kernels launched from now on use at most n
    OpenMP threads. OMP_NUM_THREADS covers a runtime not loaded yet (its default for every
    thread, and for child processes); omp_set_num_threads, the thread calling this, which is
    the one that launches a single device's kernels (an L0 mesh's device threads keep theirs)."""
    if int(n) < 1:
        raise DTMError(E.ATTRIBUTE_VALUE, f"set_num_threads: expected a positive number of threads, found {n}")
    os.environ["OMP_NUM_THREADS"] = str(int(n))
    lib = _openmp()
    if lib is not None:
        lib.omp_set_num_threads(ctypes.c_int(int(n)))


def get_num_threads() -> int:
    """torch.get_num_threads: the OpenMP threads a kernel launched from this thread may use."""
    lib = _openmp()
    if lib is None:
        return int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    return int(lib.omp_get_max_threads())


__all__ = ["CpuBackend", "Plan", "PlanCache", "ModuleHashes", "STATS", "TensorType", "set_num_threads",
           "get_num_threads"]
