"""This process's place among the ranks of a multi-process mesh (spec 9.6), and the
collectives between processes on numpy arrays.

    pg = init()                     # DTM_COORDINATOR, DTM_RANK, DTM_WORLD_SIZE, DTM_TOKEN
    y = pg.all_reduce(x, "sum")     # every rank gets the sum of all ranks' x
    shutdown()

`init` runs the coordinator in a thread when this is rank 0 and no other one runs
(DTM_COORDINATOR_EXTERNAL), joins the mesh, starts heartbeats, and connects every pair of
ranks: shared memory for groups of ranks on one host, TCP between hosts (dtm.comm). Without
DTM_COORDINATOR (and DTM_WORLD_SIZE unset or 1) it makes a group of one process.

A collective that fails because a peer died or hung (its connection closed, it stopped
heartbeating, or another rank reported losing it) raises PeerLost naming that rank and the
last operation its heartbeats reported. A blocked collective is woken when the coordinator
says a peer it needs is lost, so a survivor hears within `Membership.detection_bound`
(6.5 s by default) of the lost rank's last heartbeat, and at once when its process ended.

`cancel(reason)` cancels the whole job (spec 9.4.10): the coordinator tells every rank, each
shuts its data connections down, so that whatever collective or transfer it is in ends at
once, and that one and every later one raises Cancelled naming who cancelled and why.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from ..cluster.activity import activity
from ..cluster.cancel import Cancelled
from ..cluster.coordinator import Coordinator
from ..cluster.env import Axes, metrics_env, rank_env
from ..cluster.launchers import with_launcher
from ..cluster.heartbeat import Figures
from ..cluster.launch import declare_elastic
from ..cluster.membership import Membership, join
from ..comm.calls import call_site
from ..comm.collectives import Communicator
from ..comm.inproc import InprocHub
from ..comm.shm import connect_local, session_of
from ..comm.tcp import connect_mesh, listen
from ..comm.transport import DEFAULT_TIMEOUT_S, PeerLost
from ..errors import DTMError, ErrorCode as E
from ..ir.dtypes import from_numpy
from ..ref.collectives import call_args
from ..ref.context import group_ranks
from .abandon import abandon, resume, stand_in

log = logging.getLogger("dtm.cluster")

DEFAULT_INIT_TIMEOUT_S = 60.0
SHUTDOWN_GRACE_S = 10.0  # rank 0 waits this long for the others to leave before its coordinator stops

T = TypeVar("T")
Axis = str | Sequence[str] | None


class ProcessGroup:
    """The ranks of this mesh as seen from this process; made by `init`."""

    def __init__(self, rank: int, world_size: int, *, axes: Axes = (), membership: Membership | None = None,
                 coordinator: Coordinator | None = None):
        self.rank, self.world_size, self.axes = rank, world_size, tuple(axes)
        self.membership, self.coordinator = membership, coordinator
        self.comm: Communicator | None = None
        self.last_op = ""
        # For the L2 services (the mesh's store) that `on_join` hooks start: the cluster token,
        # the mesh's epoch and session name, each rank's machine and service address.
        self.token = b""
        self.epoch = 0
        self.session = ""
        self.nodes: tuple[str, ...] = ()
        self.service_addresses: tuple[tuple[str, int], ...] = ()
        self.service_listener: socket.socket | None = None
        self._cancelled: Cancelled | None = None  # a group without membership: its own cancel
        self._closers: list[Callable[[], None]] = []
        # Live resize (dtm/elastic): while `poison` is set (a training step's body runs), a
        # collective that fails because a peer is lost marks the epoch `broken` and returns
        # NaN (zeros for integers) instead of raising, as does every later one of the epoch:
        # the step is redone on the resized mesh, and its results are never used.
        self._poison = False
        self.broken: str | None = None
        self.joined_running = False  # this process joined a mesh that had formed (an elastic grow)

    def _attach(self, comm: Communicator) -> None:
        self.comm = comm
        if self.membership is not None:
            self.membership.watch_lost(self._on_lost)
            self.membership.watch_cancel(self._on_cancel)

    def reform(self, timeout: float, successor: tuple[str, int] | None = None) -> None:
        """Move this rank into the next epoch of its elastic mesh (spec 9.6.7): rejoin through
        the coordinator with a new data address (through the one at `successor` when the
        job's own is lost), then end this epoch's services and data connections, and connect
        to the members of the view the coordinator published, each collective bounded as
        before; `rank`, `world_size`, `axes` and `epoch` are then the new view's. The caller
        (dtm/elastic) moves the state.
        E1004 when the new mesh has no place for this rank; E1010 when the resize fails."""
        m = self.membership
        if m is None:
            raise DTMError(E.NOT_INITIALIZED, "a process group of one process has no mesh to resize")
        deadline = time.monotonic() + timeout
        op_timeout = self._comm().transport.timeout
        listener = listen(m.view.members[self.rank].host, 0)
        try:
            # The old epoch's services stay open until the new view comes: the coordinator
            # publishes it once every member rejoined, so until then a peer may still read
            # this rank's part of the old store (dtm/elastic carries snapshots that way).
            address = listener.getsockname()[:2]
            view = m.rejoin(*address, timeout=timeout) if successor is None else \
                m.take_over(successor, self.token, *address, timeout=timeout)
            self._end_epoch()
            self.rank, self.world_size, self.axes = m.rank, m.world_size, tuple(view.axes)
            self.broken = None
            self.comm = Communicator(_connect(m, listener, self.token, deadline, op_timeout))
        except BaseException:
            listener.close()
            raise
        _start_services(self, self.token, view, session_of(self.token, _addresses(view), view.epoch))

    def _end_epoch(self) -> None:
        """Close this epoch's services and data connections (their peers are resizing too, or lost)."""
        self._run_closers()
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.close()
            except DTMError as e:
                log.info("rank %d: closing the data connections of epoch %d: %s", self.rank, self.epoch, e)

    def figures(self) -> Figures:
        """What this rank's heartbeats report (read on the heartbeat thread): its collectives
        and the L2 services' activity (ingest, loading) added together."""
        a = activity()
        extra = dict(helper_cpu_percent=a.helper_cpu_percent, helper_rss_bytes=a.helper_rss_bytes,
                     workers=tuple(a.workers.values()))
        if self.comm is None:
            return Figures(a.bytes_written, a.bytes_read, a.items, a.state or "connecting to the mesh", **extra)
        tp = self.comm.transport
        return Figures(tp.bytes_sent + a.bytes_written, tp.bytes_received + a.bytes_read, self.comm.ops_done + a.items,
                       a.state or self.last_op, **extra)

    def _on_lost(self, rank: int, message: str) -> None:
        # On the heartbeat thread: end whatever waits for `rank` now, not at the timeout.
        if self.poison and self.broken is None:
            # an elastic step's body runs: the mesh resizes and the step is redone from the
            # snapshot whether or not this rank's own collectives need `rank`, so it stops at
            # its next collective rather than computing on to one that fails
            self._break(message)
        comm = self.comm  # None once closed
        sever = getattr(comm.transport, "sever", None) if comm is not None else None
        if sever is not None:
            sever(rank)

    @property
    def cancelled(self) -> Cancelled | None:
        """The job's cancel, once this rank heard of it (or asked for it); else None."""
        return self.membership.cancelled if self.membership is not None else self._cancelled

    def _on_cancel(self, cancel: Cancelled) -> None:
        # On the thread that heard of it, once `cancelled` says so (the membership marks it
        # before it calls its watchers), so that the errors the severed connections cause
        # are reported as the cancel: every wait ends at once.
        comm = self.comm
        sever = getattr(comm.transport, "sever", None) if comm is not None else None
        if sever is not None:
            for peer in range(self.world_size):
                if peer != self.rank:
                    sever(peer)
        for ref in list(_cancel_watchers):
            watcher = ref()
            try:
                if watcher is not None:
                    watcher(cancel)
            except Exception as e:  # noqa: BLE001 - the thread that heard it (heartbeats) goes on
                log.warning("rank %d: a watcher of the job's cancel failed: %r", self.rank, e)

    def cancel(self, reason: str) -> None:
        """Cancel the whole job for `reason` (spec 9.4.10): the coordinator tells every rank;
        this rank's operations raise Cancelled from now on."""
        if not isinstance(reason, str):
            raise DTMError(E.ATTRIBUTE_TYPE, f"cancel takes the reason as a string, not {type(reason).__name__}")
        if self.membership is None:  # a group of one process: the first cancel counts, as the coordinator's
            if self._cancelled is None:
                self._cancelled = Cancelled(self.rank, reason)
                self._on_cancel(self._cancelled)
            return
        self.membership.request_cancel(reason)
        self.membership.record_cancel(Cancelled(self.rank, reason))  # not waiting for the coordinator's relay

    def check_cancelled(self, what: str) -> None:
        """Cancelled naming `what` once the job is cancelled."""
        if self.cancelled is not None:
            raise self.cancelled.during(what)

    # --- groups from mesh axes ---------------------------------------------------------------

    def group(self, axis: Axis) -> tuple[int, ...] | None:
        """The ranks that share this rank's coordinates on every mesh axis but `axis` (a name
        or several), in row-major order of the named axes as given; None for all ranks."""
        if axis is None:
            return None
        names = (axis,) if isinstance(axis, str) else tuple(axis)
        sizes = dict(self.axes)
        unknown = [a for a in names if a not in sizes]
        if unknown or not names or len(set(names)) != len(names):
            have = ", ".join(f"{a}={n}" for a, n in self.axes) or "none (set DTM_MESH_AXES or dtm launch --axes)"
            raise DTMError(E.UNKNOWN_MESH_AXIS if unknown else E.INVALID_GROUP,
                           f"axis {list(names)}: the mesh's axes are {have}")
        return group_ranks(self.axes, self.rank, names)

    # --- running a collective -------------------------------------------------------------------

    def _comm(self) -> Communicator:
        if self.comm is None:
            raise DTMError(E.NOT_INITIALIZED, "the process group is closed: call dtm.init() again")
        return self.comm

    def run(self, what: str, fn: Callable[[], T]) -> T:
        """Run one operation as `what` (it names it in heartbeats and errors); an error a
        lost peer caused becomes PeerLost naming that peer, and any error after the job was
        cancelled becomes Cancelled, as does every call from then on."""
        self.last_op = what
        self.check_cancelled(what)
        try:
            return fn()
        except DTMError as err:
            lost = self._lost_peer(err, what)  # waits for the coordinator's word: a lost peer, or a cancel
            if self.cancelled is not None:
                raise self.cancelled.during(what) from err
            if lost is None:
                raise
            raise lost from err

    def _lost_peer(self, err: DTMError, what: str) -> PeerLost | None:
        m = self.membership
        if m is None or err.code not in (E.PEER_LOST, E.COLLECTIVE_ABORTED, E.TIMEOUT):
            return None
        peer = err.peer if isinstance(err, PeerLost) else None
        # When a peer died the coordinator heard of it as soon as this rank did: wait for its
        # notice (and the last operation it names). CollectiveAborted quotes the peer's code.
        caused = err.code is E.PEER_LOST or E.PEER_LOST.value in err.message
        found = m.wait_lost(m.detection_bound if caused else 0.0, prefer=peer)
        if found is not None:
            return PeerLost(found[0], what, found[1])
        if peer is not None and peer not in m.left:
            return PeerLost(peer, what, f"its last operation was {m.last_op(peer)} ({err})")
        return None

    def _describe(self, op: str, x: np.ndarray | None, group: tuple[int, ...] | None, args: str = "") -> str:
        what = f"{op}({args})"
        if x is not None:
            try:
                what += f" {from_numpy(x.dtype).name}{list(x.shape)}"
            except KeyError:  # not a DTM dtype: the collective itself reports it
                what += f" {x.dtype}{list(x.shape)}"
        over = "all ranks" if group is None else f"ranks {list(group)}"
        return f"{what} over {over} at {call_site()}"

    # --- the collectives (numpy in, numpy out) ------------------------------------------------------

    def collective(self, name: str, x: np.ndarray | None, group: tuple[int, ...] | None,
                   out: np.ndarray | None = None, **params) -> np.ndarray | None:
        """The Communicator's collective `name` over process ranks `group` (None: all), with
        its parameters; they name the call in heartbeats and errors, as in
        "reduce_scatter(sum, dim=0)". A barrier has no operand and no result. `out`: an
        array of the result's type for an all_reduce to write into (and return)."""
        if name == "barrier":
            self._poisonable(lambda: self.run(self._describe(name, None, group), lambda: self._comm().barrier(group)))
            return None
        x = np.asarray(x)
        fn = getattr(self._comm(), name)
        into = {"out": out} if out is not None else {}
        return self._poisonable(lambda: self.run(self._describe(name, x, group, call_args(params)),
                                                 lambda: fn(x, **params, group=group, **into)),
                                lambda: poisoned(name, x, len(group) if group is not None else self.world_size, params))

    @property
    def poison(self) -> bool:
        """Set while dtm.elastic runs a step's body (see __init__)."""
        return self._poison

    @poison.setter
    def poison(self, on: bool) -> None:
        self._poison = on
        if not on:  # the body ended: a later program runs whole again
            resume()

    def _break(self, why: str) -> None:
        """Mark this epoch broken while a step's body runs: its collectives give stand-ins
        from now on, and the executor skips the rest of its program (runtime.abandon)."""
        self.broken = why
        log.warning("rank %d: %s; this step is redone once the mesh has resized", self.rank, why)
        abandon()

    def _poisonable(self, op: Callable[[], T], fake: Callable[[], T] = lambda: None) -> T:
        """`op()`, or, while `poison` is set and this epoch lost a peer, `fake()` (see __init__)."""
        if self.poison and self.broken is not None:
            return fake()
        try:
            return op()
        except DTMError as err:
            if not self.poison or err.code not in (E.PEER_LOST, E.COLLECTIVE_ABORTED):
                raise
            self._break(err.message)
            return fake()

    def all_reduce(self, x: np.ndarray, op: str = "sum", axis: Axis = None, compress: str | None = None) -> np.ndarray:
        return self.collective("all_reduce", x, self.group(axis), op=op, **_compressed(compress))

    def all_gather(self, x: np.ndarray, dim: int = 0, axis: Axis = None, compress: str | None = None) -> np.ndarray:
        return self.collective("all_gather", x, self.group(axis), dim=dim, **_compressed(compress))

    def reduce_scatter(self, x: np.ndarray, op: str = "sum", dim: int = 0, axis: Axis = None,
                       compress: str | None = None) -> np.ndarray:
        return self.collective("reduce_scatter", x, self.group(axis), op=op, dim=dim, **_compressed(compress))

    def broadcast(self, x: np.ndarray, src: int = 0, axis: Axis = None) -> np.ndarray:
        return self.collective("broadcast", x, self.group(axis), src=src)

    def all_to_all(self, x: np.ndarray, split_dim: int = 0, concat_dim: int = 0, axis: Axis = None) -> np.ndarray:
        return self.collective("all_to_all", x, self.group(axis), split_dim=split_dim, concat_dim=concat_dim)

    def barrier(self, axis: Axis = None) -> None:
        self.collective("barrier", None, self.group(axis))

    def send(self, x: np.ndarray, dst: int) -> None:
        x = np.asarray(x)
        self._poisonable(lambda: self.run(self._describe("send", x, (self.rank, dst), f"dst={dst}"),
                                          lambda: self._comm().send(x, dst)))

    def recv(self, src: int, *, dtype=None, shape: Sequence[int] | None = None) -> np.ndarray:
        def fake() -> np.ndarray:
            if dtype is None or shape is None:  # nothing to make a stand-in of: the step cannot go on
                raise DTMError(E.PEER_LOST, f"recv from rank {src} in a step whose mesh lost a peer: {self.broken}")
            return poisoned("recv", np.empty(tuple(shape), dtype), 1, {})
        return self._poisonable(lambda: self.run(self._describe("recv", None, (src, self.rank), f"src={src}"),
                                                 lambda: self._comm().recv(src, dtype=dtype, shape=shape)), fake)

    # --- ending ---------------------------------------------------------------------------------

    def _run_closers(self) -> None:
        for closer in reversed(self._closers):
            try:
                closer()
            except Exception as e:  # noqa: BLE001 - closing goes on; the data connections still close
                log.warning("rank %d: closing a service: %s", self.rank, e)
        self._closers.clear()

    def close(self) -> None:
        """Flush and close the data connections (Leave to every peer), leave the mesh, and,
        on the rank that runs the coordinator, let the others leave before it stops."""
        self._run_closers()
        try:
            if self.comm is not None:
                self.comm.close()
        except DTMError as e:
            log.warning("rank %d: closing the data connections: %s", self.rank, e)
        finally:
            self.comm = None
            if self.membership is not None:
                self.membership.leave("shutdown")
            if self.coordinator is not None:
                self.coordinator.finished.wait(SHUTDOWN_GRACE_S)
                self.coordinator.stop()


def poisoned(name: str, x: np.ndarray, group_size: int, params: dict) -> np.ndarray:
    """The stand-in result of collective `name` of `x` over `group_size` ranks in a step
    that lost a peer: its shape and dtype, filled with NaN (zeros for integers and bools)."""
    shape = list(x.shape)
    if name == "all_gather":
        shape[params.get("dim", 0)] *= group_size
    elif name == "reduce_scatter":
        shape[params.get("dim", 0)] //= group_size
    elif name == "all_to_all":
        shape[params.get("split_dim", 0)] //= group_size
        shape[params.get("concat_dim", 0)] *= group_size
    return stand_in(shape, x.dtype)


def _compressed(compress: str | None) -> dict:
    """The `compress` parameter of a collective, when one was asked for (spec 9.5.1)."""
    return {} if compress is None else {"compress": compress}


# --- the process's group --------------------------------------------------------------------------

_current: ProcessGroup | None = None
_lock = threading.Lock()
_atexit_registered = False
_join_hooks: list[Callable[[ProcessGroup], Callable[[], None] | None]] = []
_cancel_watchers: list[weakref.WeakMethod] = []


def on_join(hook: Callable[[ProcessGroup], Callable[[], None] | None]) -> None:
    """Run `hook(pg)` each time this process joins a mesh of several processes, once every
    pair of ranks is connected; what it returns is called when the group closes. The L2
    services (layer 8) start here, so that a rank serves its part of the mesh's store from
    the moment the mesh exists, whether or not its own program ever touches the store."""
    _join_hooks.append(hook)


def init(timeout: float | None = None, *, op_timeout: float = DEFAULT_TIMEOUT_S, elastic: bool = False) -> ProcessGroup:
    """Join the mesh the DTM_* environment describes (cluster/env.py) and return once every
    pair of ranks is connected; TIMEOUT after `timeout` s (default 60) naming what did not
    come. `op_timeout` bounds each collective. `elastic=True` declares that this job goes on
    when a rank fails: `dtm launch` then keeps the other ranks running (its `--on-failure`
    default). A second call returns the same group."""
    global _current, _atexit_registered
    if elastic:  # first: a rank that fails while the others join must find it declared
        declare_elastic()
    with _lock:
        if _current is not None:
            return _current
        env = rank_env(with_launcher(os.environ))  # (torchrun's, Slurm's or Open MPI's variables too)
        timeout = DEFAULT_INIT_TIMEOUT_S if timeout is None else float(timeout)
        if env.single:
            pg = ProcessGroup(0, 1)
            pg._attach(Communicator(InprocHub(1).transports(timeout=op_timeout)[0]))
        else:
            pg = _join(env, timeout, op_timeout)
        _current = pg
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        return pg


def _join(env, timeout: float, op_timeout: float) -> ProcessGroup:
    deadline = time.monotonic() + timeout
    coordinator = None
    if env.hosts_coordinator:
        host, port = env.coordinator
        coordinator = Coordinator(env.world_size, env.token, host=host, port=port, axes=env.axes,
                                  heartbeat_ms=env.heartbeat_ms, timeout_ms=env.timeout_ms, join_timeout=timeout,
                                  host_rank=0, metrics=metrics_env()).start()
    membership = listener = None
    try:
        membership, listener = join(env.coordinator, env.token, rank=env.rank, world_size=env.world_size,
                                    timeout=timeout, host=env.host)
        view = membership.view
        pg = ProcessGroup(membership.rank, membership.world_size, axes=view.axes, membership=membership,
                          coordinator=coordinator)
        pg.joined_running = view.epoch > 1
        membership.start(pg.figures)
        pg._attach(Communicator(_connect(membership, listener, env.token, deadline, op_timeout)))
        _start_services(pg, env.token, view, session_of(env.token, _addresses(view), view.epoch))
        return pg
    except BaseException as err:
        if listener is not None:
            listener.close()
        if membership is not None:
            membership.leave("could not connect to the mesh")
        if coordinator is not None:
            coordinator.stop()
        lost = membership.wait_lost(0.0) if membership is not None and isinstance(err, DTMError) else None
        if lost is not None:  # a rank died while the others connected to it
            raise PeerLost(lost[0], "forming the mesh", lost[1]) from err
        raise


def _addresses(view) -> list[tuple[str, int]]:
    return [(m.host, m.port) for m in view.members]


def _connect(membership: Membership, listener: socket.socket, token: bytes | str, deadline: float,
             op_timeout: float):
    """The transport between every pair of ranks of `membership`'s view: shared memory among
    the ranks of one host, TCP otherwise; each operation bounded by `op_timeout`."""
    view, rank = membership.view, membership.rank
    mine = view.members[rank].node
    local = [r for r, m in enumerate(view.members) if m.node == mine]
    connect = connect_local if len(local) > 1 else connect_mesh
    kw = {"local": local} if len(local) > 1 else {}
    transport = connect(rank, len(view.members), _addresses(view), token, listener=listener, epoch=view.epoch,
                        timeout=max(deadline - time.monotonic(), 1.0), **kw)
    transport.timeout = op_timeout
    transport.nodes = tuple(m.node for m in view.members)  # hierarchical collectives group by it
    return transport


def _start_services(pg: ProcessGroup, token: bytes | str, view, session: str) -> None:
    """Open this rank's service listener beside its data one, learn every rank's (one
    all_gather of the ports), and run the join hooks."""
    pg.token = token.encode() if isinstance(token, str) else token
    pg.epoch, pg.session = view.epoch, session
    pg.nodes = tuple(m.node for m in view.members)
    host = view.members[pg.rank].host
    pg.service_listener = listen(host, 0)
    ports = pg.all_gather(np.array([pg.service_listener.getsockname()[1]], np.int64))
    pg.service_addresses = tuple((m.host, int(p)) for m, p in zip(view.members, ports))
    pg._closers.append(pg.service_listener.close)
    for hook in _join_hooks:
        closer = hook(pg)
        if closer is not None:
            pg._closers.append(closer)


def cancel(reason: str) -> None:
    """Cancel the whole job from this rank (spec 9.4.10): every rank's current collective,
    transfer, mesh-store request and checkpoint save, and every later one, raises
    Cancelled naming this rank and `reason`. Returns once the request is sent to the
    coordinator (E1006 when it did not announce CAP_CANCEL); this rank is cancelled from then on."""
    current().cancel(reason)


def on_cancel(method: Callable[[Cancelled], None]) -> None:
    """Call the bound method `method(cancel)` when this process's job is cancelled (at once
    when it is already). It must not block. Held weakly: an object that watches (a task
    graph's run, layer 8) is not kept alive by it."""
    _cancel_watchers[:] = [r for r in _cancel_watchers if r() is not None]
    _cancel_watchers.append(weakref.WeakMethod(method))
    cancel = cancelled()
    if cancel is not None:
        method(cancel)


def cancelled() -> Cancelled | None:
    """This process's job's cancel, once it heard of it; None otherwise (and outside a
    process group)."""
    pg = _current
    return pg.cancelled if pg is not None else None


def check_cancelled(what: str) -> None:
    """Cancelled naming `what` when this process's job was cancelled; nothing otherwise."""
    pg = _current
    if pg is not None:
        pg.check_cancelled(what)


def current() -> ProcessGroup:
    """The group `init` made; E1005 before `init` or after `shutdown`."""
    if _current is None:
        raise DTMError(E.NOT_INITIALIZED, "this process is in no process group: call dtm.init() first (rank(), "
                                          "world_size() and the collectives between processes need it)")
    return _current


def is_initialized() -> bool:
    """torch.distributed.is_initialized: whether this process is in a process group (after
    `init`, before `shutdown`)."""
    return _current is not None


def rank() -> int:
    """This process's rank, 0 to world_size() - 1."""
    return current().rank


def world_size() -> int:
    """The number of ranks in the mesh."""
    return current().world_size


def shutdown() -> None:
    """Leave the mesh: close the data connections with Leave, then the coordinator's. Safe to
    call twice; also runs at exit."""
    global _current
    with _lock:
        pg, _current = _current, None
    if pg is not None:
        pg.close()
