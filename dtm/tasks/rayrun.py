"""The Ray backend of task graphs: `graph.run(backend="ray")` (spec 9.3). Each task becomes
one Ray task of `execute` below, whose worker opens the same store (a directory or fsspec
URL, never `memory://`), imports the task function by `module:qualname` (an IR task gets
its module's text and the func's name) and runs it with `run_task`, as a local worker
process does. Only strings cross: the store URL, the function's name, the keys; tensors go
through the store, and the driver gets back a small status dict.

Mapping onto Ray:
* placement: a task is handed to Ray once every task in its `after` has finished (so a
  failed or cancelled graph never starts its dependents), at most `workers` at a time
  (default: the cluster's CPUs); Ray picks the node and worker (`num_cpus=1` each).
* retries: `max_retries=task.retries` for a worker that died, `retry_exceptions=False`:
  a raising task is not retried (it does not even raise into Ray: it reports its error).
* cancel: `ray.cancel(ref)` interrupts the running task (Ray calls `_thread.interrupt_main()`
  in its worker, which runs our SIGINT handler at the next bytecode: inside the function it
  stops at once, elsewhere at its next boundary, never between its output puts); a task
  blocked in a system call (a long sleep, a socket read) does not see it, so after
  CANCEL_GRACE_S `ray.cancel(ref, force=True)` kills the worker.
* timeout: the worker's own SIGALRM interrupts the attempt at `timeout` (as a cancel does);
  the driver force-cancels an attempt that has not answered within `timeout` plus
  START_ALLOWANCE_S after it was handed to Ray (a worker stuck in native code).

Layer: row 8. `ray` is imported only when a Ray run starts (`pip install dtm[ray]`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ..errors import DTMError, ErrorCode
from ..ir.parser import parse
from ..ir.printer import format as module_text
from ..store import open as open_store
from .errors import GraphError, TaskError, TaskFailed, TaskTimeout, WorkerLost
from .functions import IRFunction, Interrupted, Outcome, PyFunction, reference, resolve, run_task
from .interrupt import Flags, Guarded, on_signal, stopped
from .progress import Bar, wanted
from .run import RunBase
from .report import CANCELLED, DONE, FAILED, RUNNING

if TYPE_CHECKING:
    from .graph import Graph

CANCEL_GRACE_S = RunBase.CANCEL_GRACE_S  # an interrupted Ray task gets this long before its worker is killed
START_ALLOWANCE_S = 60.0  # a fresh Ray worker starting and importing dtm, before its own timer runs
TICK_S = 0.02  # the driver's longest wait on Ray before it looks at cancel, deadlines and the bar


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise GraphError(ErrorCode.UNKNOWN_BACKEND, "the ray task backend needs Ray: pip install 'dtm[ray]'") from None
    return ray


# --- the worker's side: runs inside a Ray worker process -----------------------------------

_stores: dict[str, Any] = {}
_functions: dict[tuple, Any] = {}


def _function(spec: tuple) -> Guarded:
    """("py", "module:qualname", jit) or ("ir", module text, func, backend), imported once per worker."""
    found = _functions.get(spec)
    if found is None:
        if spec[0] == "py":
            fn: PyFunction | IRFunction = PyFunction(resolve(spec[1]), bool(spec[2]), spec[1])
        else:
            fn = IRFunction(parse(spec[1]), spec[2], spec[3])
        found = _functions[spec] = Guarded(fn)
    return found


def _worker_name(ray: Any) -> str:
    ctx = ray.get_runtime_context()
    return f"ray node {ctx.get_node_id()[:8]} worker {ctx.get_worker_id()[:8]} (pid {os.getpid()})"


def _attempt(ray: Any) -> int:
    try:  # not public API: the count of this task's earlier attempts (worker deaths)
        return int(ray._private.worker.global_worker.core_worker.get_current_task_attempt_number()) + 1
    except Exception:
        return 1


def execute(url: str, spec: tuple, inputs: tuple[str, ...], outputs: tuple[str, ...],
            timeout: float | None) -> dict[str, Any]:
    """One attempt of one task on a Ray worker. Returns {"ok": True, read, written, seconds},
    {"ok": False, "stopped": "cancel"|"timeout"} or {"ok": False, code, type, message}; never
    raises for the task's own fault, so Ray never retries one."""
    import ray

    reply: dict[str, Any] = {"worker": _worker_name(ray), "attempt": _attempt(ray)}
    main = threading.current_thread() is threading.main_thread()
    Flags.stop, Flags.in_function = None, False
    saved = {}
    if main:  # Ray's cancel calls _thread.interrupt_main(): SIGINT's handler, in this thread
        saved[signal.SIGINT] = signal.signal(signal.SIGINT, on_signal)
        if timeout is not None:
            saved[signal.SIGALRM] = signal.signal(signal.SIGALRM, on_signal)
            signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        store = _stores.get(url)
        if store is None:
            store = _stores[url] = open_store(url)
        outcome = run_task(store, _function(spec), inputs, outputs, stopped)
        reply.update(ok=True, read=outcome.read, written=outcome.written, seconds=outcome.seconds)
    except (Interrupted, KeyboardInterrupt):
        reply.update(ok=False, stopped=Flags.stop or "cancel")
    except Exception as e:  # the task's own fault: reported, never retried
        reply.update(ok=False, code=e.code.value if isinstance(e, DTMError) else None, type=type(e).__name__,
                     message=e.message if isinstance(e, DTMError) else str(e))
    finally:
        if main:
            if timeout is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
            for sig, handler in saved.items():
                signal.signal(sig, handler)
    return reply


# --- the driver's side ----------------------------------------------------------------------

_remote: Any = None


class RayRun(RunBase):
    """The handle `Graph.run(backend="ray")` returns: wait, status, cancel, report, as LocalRun."""

    def __init__(self, graph: "Graph", deps: list[list[int]], workers: int | None, progress: bool | None):
        global _remote
        ray = self.ray = _import_ray()
        tasks = graph.tasks
        url = getattr(graph.store, "url", "")
        if not url or url.startswith("memory://"):
            raise GraphError(ErrorCode.ATTRIBUTE_VALUE, "Ray tasks need a store their workers can open (a directory "
                             f"or fsspec URL), not the process-local {url or graph.store!r}")
        self.url = url
        self.specs: list[tuple] = []
        texts: dict[int, str] = {}
        for t in tasks:  # every function reachable by name before anything runs (E1204)
            if isinstance(t.fn, IRFunction):
                text = texts.get(id(t.fn.module))
                if text is None:
                    text = texts[id(t.fn.module)] = module_text(t.fn.module)
                self.specs.append(("ir", text, t.fn.func, t.fn.backend))
            else:
                self.specs.append(("py", t.fn.ref or reference(t.fn.fn), t.fn.jit))
        if not ray.is_initialized():  # a local Ray; ray.init(address=...) first for a cluster
            path = os.pathsep.join(p or os.getcwd() for p in sys.path)
            ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
        if _remote is None:
            _remote = ray.remote(execute)
        super().__init__(graph, deps)
        n = len(tasks)
        self.cap = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.ready = deque(i for i in range(n) if self.waiting[i] == 0)
        self.bar = Bar(n) if wanted(progress) and n else None
        self.driver = threading.Thread(target=self._drive, name="dtm-task-ray", daemon=True)
        self.driver.start()

    # --- the handle -----------------------------------------------------------------------

    def _joined(self) -> None:
        self.driver.join(1.0)

    def cancel(self) -> None:
        """Hand no task to Ray any more and `ray.cancel` the running ones; returns at once."""
        with self.lock:
            if not self.ended.is_set():
                self.cancelled = self.stop = True

    # --- the driver thread ------------------------------------------------------------------

    def _drive(self) -> None:
        ray = self.ray
        inflight: dict[Any, int] = {}  # ObjectRef -> task
        deadline: dict[Any, float] = {}  # ObjectRef -> when the driver force-cancels it
        interrupted: dict[Any, float] = {}  # ObjectRef -> when ray.cancel asked it to stop
        timed_out: set = set()
        try:
            while True:
                with self.lock:
                    stop = self.stop
                if not stop:
                    while self.ready and len(inflight) < self.cap:
                        i = self.ready.popleft()
                        t = self.tasks[i]
                        ref = _remote.options(num_cpus=1, max_retries=t.retries, retry_exceptions=False,
                                              name=t.name).remote(self.url, self.specs[i], t.inputs, t.outputs,
                                                                  t.timeout)
                        inflight[ref] = i
                        if t.timeout is not None:
                            deadline[ref] = time.monotonic() + t.timeout + START_ALLOWANCE_S
                        with self.lock:
                            self.state[i] = RUNNING
                            self.attempts[i] = 1
                if not inflight:
                    break
                now = time.monotonic()
                if stop:
                    for ref in inflight:
                        if ref not in interrupted:
                            ray.cancel(ref, force=False)
                            interrupted[ref] = now
                        elif now - interrupted[ref] > CANCEL_GRACE_S:
                            self._kill(ref)
                            interrupted[ref] = float("inf")
                for ref, when in list(deadline.items()):
                    if now > when:  # no answer long past its timeout: stuck in native code
                        del deadline[ref]
                        timed_out.add(ref)
                        self._kill(ref)
                done, _ = ray.wait(list(inflight), num_returns=1, timeout=TICK_S, fetch_local=True)
                if done and len(inflight) > 1:
                    more, _ = ray.wait([r for r in inflight if r not in done], num_returns=len(inflight) - 1,
                                       timeout=0)
                    done += more
                for ref in done:
                    i = inflight.pop(ref)
                    deadline.pop(ref, None)
                    interrupted.pop(ref, None)
                    self._finished(i, ref, ref in timed_out)
                    timed_out.discard(ref)
                if self.bar:
                    s = self.status()
                    self.bar.update(s["done"], s["running"], s["failed"], s["queued"])
        except BaseException as e:  # the driver itself broke (Ray went away): fail the run, never hang
            with self.lock:
                if self.error is None:
                    self.error = TaskError(ErrorCode.WORKER_LOST, f"the Ray driver loop failed: {type(e).__name__}: {e}")
                for i in range(len(self.tasks)):
                    if self.state[i] == RUNNING:
                        self.state[i] = CANCELLED
        finally:
            with self.lock:
                self.ended_at = time.perf_counter()
                self.ended.set()
            if self.bar:
                s = self.status()
                self.bar.update(s["done"], s["running"], s["failed"], s["queued"])
                self.bar.close()

    def _kill(self, ref: Any) -> None:
        try:
            self.ray.cancel(ref, force=True)
        except Exception:  # it ended meanwhile
            pass

    def _finished(self, i: int, ref: Any, timed_out: bool) -> None:
        """Task i's Ray task ended: settle it from its reply or Ray's error."""
        ray, t = self.ray, self.tasks[i]
        state, outcome, error = DONE, None, None
        try:
            reply = ray.get(ref, timeout=30)
        except ray.exceptions.TaskCancelledError:
            reply = None
            state = FAILED if timed_out else CANCELLED
            if timed_out:
                error = TaskTimeout(t.name, t.inputs, "a Ray worker", t.timeout)
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                ray.exceptions.LocalRayletDiedError) as e:
            reply, state = None, FAILED
            if self.stop:
                state = CANCELLED
            elif timed_out:
                error = TaskTimeout(t.name, t.inputs, "a Ray worker", t.timeout)
            else:
                self.attempts[i] = t.retries + 1
                how = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                error = WorkerLost(t.name, t.inputs, "a Ray worker", t.retries + 1, how)
        except ray.exceptions.RayError as e:  # anything else Ray reports: the task failed
            reply, state = None, FAILED
            error = TaskFailed(t.name, t.inputs, "a Ray worker", type(e).__name__, str(e).strip().splitlines()[0]
                               if str(e).strip() else "")
        if reply is not None:
            self.worker[i] = reply["worker"]
            self.attempts[i] = reply.get("attempt", 1)
            if reply["ok"]:
                outcome = Outcome(reply["read"], reply["written"], reply["seconds"])
            elif reply.get("stopped") == "timeout":
                state, error = FAILED, TaskTimeout(t.name, t.inputs, reply["worker"], t.timeout)
            elif reply.get("stopped"):
                state = CANCELLED
            else:
                code = ErrorCode(reply["code"]) if reply.get("code") else ErrorCode.TASK_FAILED
                state = FAILED
                error = TaskFailed(t.name, t.inputs, reply["worker"], reply["type"], reply["message"], code)
        with self.lock:
            self._ended(i, state, outcome, error, self.ready.append)
