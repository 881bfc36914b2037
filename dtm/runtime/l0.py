"""Runtime L0: several virtual CPU devices in one process (conformance level L0).

    ex = executor()                                   # DTM_DEVICES devices (default: one per core)
    outs = ex.run(per_rank_modules, "main", per_rank_inputs)   # outs[r]: rank r's results

Each device is one worker thread. A run gives mesh rank r's local-view module (the
partitioner's output: one module per rank, since uneven shards give ranks different local
types) to device r, which runs it as a compiled plan of the `cpu` backend. Collectives in
the plan meet on a `DeviceGroup` (the reference's rendezvous, `LocalGroup.meet`): the ranks
post their operands and read each other's buffers directly, since they share one address
space.

- Small operands, and every collective that only moves data (all_gather, all_to_all,
  broadcast), are direct: each rank reads the blocks it needs straight from the owners'
  buffers into its result, one copy, the least traffic there is in shared memory.
- Reductions of large operands (all_reduce, reduce_scatter of at least `ring_min_bytes`)
  run the ring, on the schedule every transport's ring follows (`algorithms.ring_schedule`):
  in step s rank i adds its chunk into the partial sum its left neighbour made in step
  s-1, read straight from the neighbour's buffer, so after n-1 steps each rank holds one
  reduced chunk and every rank did 1/n of the arithmetic (the direct path makes every
  rank reduce all of it); all_reduce then passes the reduced chunks round the ring (n-1
  more steps). Each chunk is reduced once, so every rank receives bitwise the same result
  (spec 3.11).

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

from ..comm import algorithms as alg
from ..errors import DTMError, ErrorCode as E
from ..ir.module import Module
from ..ref import reduction
from ..ref.collectives import describe, result
from ..ref.context import DEFAULT_TIMEOUT_S, RefContext
from ..ref.local_group import LocalGroup, Meeting
from .backend import compiled_plan

RING_MIN_BYTES = 1 << 20  # reductions of at least this many bytes per rank take the ring
RUN_TIMEOUT_S = 3600.0    # how long a caller waits for a whole run


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

class DeviceGroup(LocalGroup):
    """The `Comm` of the devices of one run: the members meet as in the reference
    (LocalGroup.meet) and read each other's buffers in place (see the module docstring);
    barrier and send/recv are the reference's."""

    def __init__(self, size: int, ring_min_bytes: int = RING_MIN_BYTES):
        super().__init__(size)
        self.ring_min_bytes = ring_min_bytes

    def collective(self, name: str, attrs: dict, x: np.ndarray, group: tuple[int, ...], index: int, rank: int,
                   timeout: float) -> np.ndarray | None:
        x = np.asarray(x, order="C")  # (not ascontiguousarray: it makes a 0-d array 1-d)
        ring = name in ("all_reduce", "reduce_scatter") and x.nbytes >= self.ring_min_bytes \
            and reduction.work_dtype(x.dtype) == x.dtype and not (attrs["op"] == "avg" and x.dtype.kind in "iu")
        with self.meet(describe(name, attrs, x), x, group, index, rank, timeout) as (m, step):
            if not ring:
                return result(name, attrs, m.inputs, index)
            return _ring(m, index, name, attrs, step)


def _ring(m: Meeting, index: int, name: str, attrs: dict, step: Callable[[], None]) -> np.ndarray:
    """Ring all_reduce or reduce_scatter over the members' operands, following the schedule
    every transport's ring follows (`algorithms.ring_schedule`, here over whole blocks: its
    unit ranges [k, k+1) name block k). Where a transport receives a chunk, this member
    reads it straight from its left neighbour's buffer (its operand in the first step, its
    partial result after); `step()` between the ring's steps keeps the members in lock step.
    Each block is reduced once, so every member gets bitwise the same result."""
    n, x, op = len(m.inputs), m.inputs[index], attrs["op"]
    if name == "all_reduce":
        bounds = np.linspace(0, x.size, n + 1).astype(np.int64)

        def block(a: np.ndarray, k: int) -> np.ndarray:
            return a.reshape(-1)[bounds[k]:bounds[k + 1]]
    else:
        d = attrs["dim"]
        blocks = (int(np.prod(x.shape[:d])), n, x.shape[d] // n, int(np.prod(x.shape[d + 1:])))

        def block(a: np.ndarray, k: int) -> np.ndarray:
            return a.reshape(blocks)[:, k]

    work = m.outputs[index] = np.empty_like(x)
    left = (index - 1) % n
    _, receives = alg.ring_schedule(n, index, [(k, k + 1) for k in range(n)], 1, 0, name)
    for t, r in enumerate(receives):
        k = r.a
        if r.reduce:
            partial = m.inputs[left] if t == 0 else m.outputs[left]
            mine = block(work, k)
            reduction.combine(op, block(partial, k), block(x, k), out=mine)
            if r.finish:
                reduction.finish(op, mine, n, mine)
        else:
            block(work, k)[...] = block(m.outputs[left], k)
        step()
    if name == "all_reduce":
        return work
    return np.ascontiguousarray(block(work, index)).reshape(x.shape[:d] + (x.shape[d] // n,) + x.shape[d + 1:])


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

    def __len__(self) -> int:
        return len(self.devices)

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
        plans = [compiled_plan(m, func) for m in modules]  # compiled before any rank waits at a collective
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
    """Replace the process's executor with one of `n` devices."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        old = _EXECUTOR
        if old is not None and len(old) == n:
            return old
        _EXECUTOR = L0Executor(n)
        if old is not None:
            old.close()
        return _EXECUTOR


__all__ = ["Device", "DeviceGroup", "L0Executor", "executor", "set_device_count",
           "default_device_count", "RING_MIN_BYTES"]
