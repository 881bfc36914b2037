"""Runtime L0: several virtual CPU devices in one process (conformance level L0).

    ex = executor()                                   # DTM_DEVICES devices (default: one per core)
    outs = ex.run(per_rank_modules, "main", per_rank_inputs)   # outs[r]: rank r's results

Each device is one worker thread. A run gives mesh rank r's local-view module (the
partitioner's output: one module per rank, since uneven shards give ranks different local
types) to device r, which runs it as a compiled plan of the `cpu` backend. Collectives in
the plan meet on a `DeviceGroup`: the ranks post their operands and read each other's
buffers directly, since they share one address space.

- Small operands, and every collective that only moves data (all_gather, all_to_all,
  broadcast), are direct: each rank reads the blocks it needs straight from the owners'
  buffers into its result, one copy, the least traffic there is in shared memory.
- Reductions of large operands (all_reduce, reduce_scatter of at least `ring_min_bytes`)
  run the ring algorithm: in step s rank i adds its chunk into the partial sum its left
  neighbour made in step s-1, so after n-1 steps each rank holds one reduced chunk and
  every rank did 1/n of the arithmetic (the direct path makes every rank reduce all of
  it); all_reduce then passes the reduced chunks round the ring (n-1 more steps). Each
  chunk is reduced once, so every rank receives bitwise the same result (spec 3.11).

Nothing waits forever: a rank that waits `timeout` seconds at a collective raises DTMError
(TIMEOUT) naming the collective, the rank and the ranks that did not arrive; when one rank
fails, the group is aborted and the others stop waiting at once. One run holds the devices
at a time (two runs interleaving their collectives on the same threads could deadlock).

Devices share the machine's cores: a benchmark that wants one core per device sets
OMP_NUM_THREADS=1 so each device's kernels run on its own thread only.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..compiler.passes import compile_func
from ..errors import DTMError, ErrorCode as E
from ..ir.module import Module
from ..ref.context import DEFAULT_TIMEOUT_S, RefContext
from ..ref.local_group import LocalGroup
from ..ref.ops import _combine  # the reference reduction: group order, narrow floats in f32, integer avg
from .cpu import Plan, PlanCache

RING_MIN_BYTES = 1 << 20  # reductions of at least this many bytes per rank take the ring
RUN_TIMEOUT_S = 3600.0    # how long a caller waits for a whole run
COLLECTIVES = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"})
_RING_DTYPES = frozenset("f4 f8 i1 i2 i4 i8 u1 u2 u4 u8".split())  # reduced in their own dtype


@dataclass(frozen=True)
class Device:
    """A virtual CPU device: one worker thread of the L0 executor."""

    index: int
    kind: str = "cpu"

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"

    __repr__ = __str__


def default_device_count() -> int:
    """$DTM_DEVICES, else one device per core."""
    text = os.environ.get("DTM_DEVICES")
    if not text:
        return os.cpu_count() or 1
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise DTMError(E.INVALID_MESH, f"DTM_DEVICES={text!r}: expected a whole number of devices >= 1")
    return n


# --- collectives between device threads -------------------------------------------------------

class _Meeting:
    """One collective of one group: the members' operands and results, and how far each
    member has got (its phase), so members can wait for each other step by step."""

    __slots__ = ("what", "inputs", "outputs", "phase", "left")

    def __init__(self, n: int):
        self.what: list[str | None] = [None] * n
        self.inputs: list[np.ndarray | None] = [None] * n
        self.outputs: list[np.ndarray | None] = [None] * n
        self.phase = [0] * n
        self.left = 0


class DeviceGroup(LocalGroup):
    """The `Comm` of the devices of one run. `collective` runs the five data collectives on
    the members' buffers in place (see the module docstring); barrier and send/recv go
    through LocalGroup's exchange and mailbox, as in the reference."""

    def __init__(self, size: int, ring_min_bytes: int = RING_MIN_BYTES):
        super().__init__(size)
        self.ring_min_bytes = ring_min_bytes
        self._meetings: dict[tuple[tuple[int, ...], int], _Meeting] = {}
        self._joined: dict[tuple[int, tuple[int, ...]], int] = {}  # (rank, group) -> collectives so far

    # -- meeting the group --
    def _wait(self, m: _Meeting, index: int, phase: int, what: str, group: tuple[int, ...], rank: int,
              deadline: float, timeout: float) -> None:
        """Mark member `index` at `phase` and wait until every member is there. Caller holds _cond."""
        m.phase[index] = phase
        self._cond.notify_all()
        while min(m.phase) < phase:
            if self.aborted is not None:
                raise DTMError(E.TIMEOUT, f"{what} on rank {rank}: abandoned, {self.aborted}")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [group[i] for i, p in enumerate(m.phase) if p < phase]
                step = "" if phase == 1 else f" (step {phase - 1})"
                raise DTMError(E.TIMEOUT, f"{what}{step} on rank {rank}: waited {timeout:g} s for ranks {missing} "
                               f"of group {list(group)}")
            self._cond.wait(left)

    def collective(self, name: str, attrs: dict, x: np.ndarray, group: tuple[int, ...], index: int, rank: int,
                   timeout: float) -> np.ndarray:
        """This rank's result of collective `name` (spec 3.11) over `group` (global ranks in
        group order; this rank is group[index])."""
        x = np.ascontiguousarray(x)
        what = f"{name}({', '.join(f'{k}={v}' for k, v in sorted(attrs.items()) if k != 'mesh')}) " \
               f"{x.dtype}{list(x.shape)}"
        n = len(group)
        deadline = time.monotonic() + timeout
        with self._cond:
            seq = self._joined.get((rank, group), 0)
            self._joined[(rank, group)] = seq + 1
            m = self._meetings.setdefault((group, seq), _Meeting(n))
            m.what[index], m.inputs[index] = what, x
            self._wait(m, index, 1, what, group, rank, deadline, timeout)
        if len(set(m.what)) > 1:
            calls = "; ".join(f"rank {r}: {w}" for r, w in zip(group, m.what))
            raise DTMError(E.COLLECTIVE_MISMATCH, f"collective #{seq} of group {list(group)} does not match "
                           f"across ranks ({calls})")
        phase = [1]

        def step() -> None:  # every member has finished the step before anyone reads its results
            phase[0] += 1
            with self._cond:
                self._wait(m, index, phase[0], what, group, rank, deadline, timeout)

        ring = name in ("all_reduce", "reduce_scatter") and x.nbytes >= self.ring_min_bytes \
            and x.dtype.str[1:] in _RING_DTYPES and not (attrs["op"] == "avg" and x.dtype.kind in "iu")
        try:
            if ring:
                y = (_ring_all_reduce if name == "all_reduce" else _ring_reduce_scatter)(m, index, attrs, step)
            else:
                y = _direct(name, attrs, m.inputs, index)
            step()  # nobody leaves while another member may still read its buffers
        finally:
            with self._cond:
                m.left += 1
                if m.left == n:
                    del self._meetings[(group, seq)]
        return y


_UFUNC = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def _direct(name: str, attrs: dict, xs: list, index: int) -> np.ndarray:
    """Read the members' operands directly; the reductions as the reference combines them."""
    n = len(xs)
    if name == "all_reduce":
        return np.asarray(_combine(xs, attrs["op"])).astype(xs[0].dtype, copy=False)
    if name == "reduce_scatter":
        mine = [np.split(x, n, axis=attrs["dim"])[index] for x in xs]
        return np.ascontiguousarray(np.asarray(_combine(mine, attrs["op"])).astype(xs[0].dtype, copy=False))
    if name == "all_gather":
        return np.concatenate(xs, axis=attrs["dim"])
    if name == "all_to_all":
        return np.concatenate([np.split(x, n, axis=attrs["split_dim"])[index] for x in xs],
                              axis=attrs["concat_dim"])
    assert name == "broadcast", name
    return xs[attrs["src"]].copy()


def _ring(m: _Meeting, index: int, op: str, chunk: Callable[[np.ndarray, int], np.ndarray],
          acc: np.ndarray, step: Callable[[], None]) -> None:
    """Ring reduce-scatter into `acc` (this rank's scratch, posted as its output): in step s
    rank i reduces chunk (i - s - 2) mod n from its left neighbour's partial (or operand, in
    step 0) and its own operand, so after n-1 steps it holds the reduced chunk i."""
    n = len(m.inputs)
    fn = _UFUNC[op]
    left = (index - 1) % n
    for s in range(n - 1):
        k = (index - s - 2) % n
        src = m.inputs[left] if s == 0 else m.outputs[left]
        fn(chunk(src, k), chunk(m.inputs[index], k), out=chunk(acc, k))
        step()


def _ring_all_reduce(m: _Meeting, index: int, attrs: dict, step: Callable[[], None]) -> np.ndarray:
    n = len(m.inputs)
    x = m.inputs[index]
    bounds = np.linspace(0, x.size, n + 1).astype(np.int64)

    def chunk(a: np.ndarray, k: int) -> np.ndarray:
        return a.reshape(-1)[bounds[k]:bounds[k + 1]]

    out = m.outputs[index] = np.empty_like(x)
    _ring(m, index, attrs["op"], chunk, out, step)
    if attrs["op"] == "avg":
        mine = chunk(out, index)
        np.divide(mine, mine.dtype.type(n), out=mine)
        step()  # divided before the neighbour copies it
    for s in range(n - 1):  # pass the reduced chunks round: rank i-1 has chunk (i - s - 1) by now
        k = (index - s - 1) % n
        chunk(out, k)[...] = chunk(m.outputs[(index - 1) % n], k)
        step()
    return out


def _ring_reduce_scatter(m: _Meeting, index: int, attrs: dict, step: Callable[[], None]) -> np.ndarray:
    n = len(m.inputs)
    x, d = m.inputs[index], attrs["dim"]
    blocks = (int(np.prod(x.shape[:d])), n, x.shape[d] // n, int(np.prod(x.shape[d + 1:])))

    def chunk(a: np.ndarray, k: int) -> np.ndarray:
        return a.reshape(blocks)[:, k]

    acc = m.outputs[index] = np.empty_like(x)
    _ring(m, index, attrs["op"], chunk, acc, step)
    shape = x.shape[:d] + (x.shape[d] // n,) + x.shape[d + 1:]
    y = np.ascontiguousarray(chunk(acc, index)).reshape(shape)
    if attrs["op"] == "avg":
        np.divide(y, y.dtype.type(n), out=y)
    return y


# --- plans that run collectives on the device group -------------------------------------------

class DevicePlan(Plan):
    """A cpu-backend plan whose collective steps run on the device group (DeviceGroup.collective)
    instead of the reference's copy-everything exchange. (It overrides the plan's fallback
    step, the one place a collective runs; quantized operands and groups of one keep the
    reference implementation.)"""

    def _fallback(self, step, vals, originals, bindings, ctx):
        op = step.op
        comm = ctx.comm if ctx is not None else None
        if op.name not in COLLECTIVES or not isinstance(comm, DeviceGroup) or op.operands[0].type.dtype.is_quant:
            return super()._fallback(step, vals, originals, bindings, ctx)
        ins, outs = self.fb_args[id(step)]
        group, index = ctx.group(op.attrs["mesh"], op.attrs["axes"])
        if len(group) == 1:
            return super()._fallback(step, vals, originals, bindings, ctx)
        x = originals.get(ins[0], vals[ins[0]])
        try:
            y = comm.collective(op.name, op.attrs, x, group, index, ctx.rank, ctx.timeout)
        except DTMError as e:
            raise DTMError(e.code, f"@{self.func.name} op {op.name} ({step.name}): {e.message}") from e
        vals[outs[0]] = y
        return ctx


# --- the executor -----------------------------------------------------------------------------

class _Worker:
    """A device's thread: runs the jobs given to it, one at a time, in order."""

    def __init__(self, device: Device):
        self.device = device
        self.jobs: queue.Queue = queue.Queue()
        self.closed = False
        self.thread = threading.Thread(target=self._main, name=f"dtm-{device}", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        while not self.closed:
            try:
                job = self.jobs.get(timeout=1.0)  # wakes now and then to notice close()
            except queue.Empty:
                continue
            job()


class L0Executor:
    """`n` virtual CPU devices, each a worker thread; `run` runs one module per rank on them."""

    def __init__(self, n: int | None = None, *, timeout: float = DEFAULT_TIMEOUT_S,
                 ring_min_bytes: int = RING_MIN_BYTES):
        n = default_device_count() if n is None else n
        if n < 1:
            raise DTMError(E.INVALID_MESH, f"an L0 executor needs at least one device, asked for {n}")
        self.devices = [Device(i) for i in range(n)]
        self.timeout = timeout
        self.ring_min_bytes = ring_min_bytes
        self._workers: list[_Worker] | None = None
        self._busy = threading.Lock()
        self.plans = PlanCache(lambda module, func: DevicePlan(module, func, compile_func(module, func)), 256)

    def __len__(self) -> int:
        return len(self.devices)

    def plan(self, module: Module, func: str) -> DevicePlan:
        """The compiled plan of @func of `module`, cached by module (object, then hash)."""
        return self.plans.get(module, func)

    def run(self, modules: Sequence[Module], func: str, inputs: Sequence[Sequence[np.ndarray]],
            devices: Sequence[int] | None = None) -> list[list[np.ndarray]]:
        """Run modules[r] on inputs[r] as mesh rank r, on device devices[r] (default: r), all
        at once; return each rank's results. Raises the first rank's error (DTMError with
        the rank in the message) after stopping the others."""
        n = len(modules)
        devices = list(range(n)) if devices is None else list(devices)
        if len(inputs) != n or len(devices) != n:
            raise DTMError(E.INVALID_GROUP, f"L0 run: {n} modules, {len(inputs)} input lists, {len(devices)} devices")
        bad = [d for d in devices if not 0 <= d < len(self.devices)]
        if bad or len(set(devices)) != n:
            raise DTMError(E.MESH_TOO_LARGE, f"L0 run: {n} ranks on devices {devices}, but this executor has "
                           f"{len(self.devices)} devices ({', '.join(map(str, self.devices))}); set DTM_DEVICES "
                           "or dtm.devices(n) for more")
        plans = [self.plan(m, func) for m in modules]  # compile before any rank waits at a collective
        group = DeviceGroup(n, self.ring_min_bytes)
        results: list = [None] * n
        failures: list[tuple[int, BaseException]] = []
        done = threading.Condition()
        finished = [0]

        def job(r: int) -> Callable[[], None]:
            def main() -> None:
                ctx = RefContext(rank=r, meshes=dict(modules[r].meshes), comm=group, timeout=self.timeout,
                                 module=modules[r])
                try:
                    results[r] = plans[r].run(inputs[r], ctx)
                except BaseException as e:  # noqa: BLE001 - reported to the caller below
                    with done:
                        failures.append((r, e))
                    group.abort(f"rank {r} failed: {e}")
                finally:
                    with done:
                        finished[0] += 1
                        done.notify_all()
            return main

        if not self._busy.acquire(timeout=RUN_TIMEOUT_S):
            raise DTMError(E.TIMEOUT, f"L0 run: the devices stayed busy with another run for {RUN_TIMEOUT_S:g} s")
        try:
            workers = self._start()
            for r in range(n):
                workers[devices[r]].jobs.put(job(r))
            deadline = time.monotonic() + RUN_TIMEOUT_S
            with done:
                while finished[0] < n:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        group.abort("the run timed out")
                        late = [r for r in range(n) if results[r] is None]
                        raise DTMError(E.TIMEOUT, f"L0 run @{func}: ranks {late} did not finish in {RUN_TIMEOUT_S:g} s")
                    done.wait(left)
        finally:
            self._busy.release()
        if failures:
            r, e = min(failures, key=lambda f: "abandoned" in str(f[1]))  # the cause, not the abandoned
            if isinstance(e, DTMError):
                raise DTMError(e.code, f"rank {r} (device {self.devices[devices[r]]}): {e.message}") from e
            e.add_note(f"on rank {r} of an L0 run")
            raise e
        return results

    def _start(self) -> list[_Worker]:
        if self._workers is None:
            self._workers = [_Worker(d) for d in self.devices]
        return self._workers

    def close(self) -> None:
        """Let the worker threads end (they notice within a second)."""
        for w in self._workers or ():
            w.closed = True
        self._workers = None


_EXECUTOR: L0Executor | None = None
_EXECUTOR_LOCK = threading.Lock()


def executor() -> L0Executor:
    """The process's L0 executor ($DTM_DEVICES devices, or as `set_device_count` said)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = L0Executor()
        return _EXECUTOR


def set_device_count(n: int) -> L0Executor:
    """Replace the process's executor with one of `n` devices (plans compiled so far are kept)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        old = _EXECUTOR
        if old is not None and len(old) == n:
            return old
        _EXECUTOR = L0Executor(n)
        if old is not None:
            _EXECUTOR.plans = old.plans
            old.close()
        return _EXECUTOR


__all__ = ["Device", "DeviceGroup", "DevicePlan", "L0Executor", "executor", "set_device_count",
           "default_device_count", "RING_MIN_BYTES"]
