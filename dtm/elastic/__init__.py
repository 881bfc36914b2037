"""Live mesh resize, the training loop's side (spec 9.6.7): `steps` runs a loop whose mesh
of processes shrinks when a rank dies and grows when ranks join, without a restart.

    dtm.init()                                  # under dtm launch --elastic MIN:MAX --axes dp=2,tp=2
    mesh = dtm.Mesh(dtm.init().axes)            # the launch's axes
    state = {"model": model, "optim": opt, "loader": loader, "sched": sched}
    for step in dtm.elastic.steps(state, total=1000, snapshot_every=1):
        loss = train_step(*next(loader))         # redone on the new mesh when a rank was lost

At each step boundary the loop takes an in-memory snapshot of `state` on the peers (every
`snapshot_every` steps, dtm.checkpoint.snapshot, completed before the step runs) and asks
the mesh, with one small all_reduce, whether the coordinator announced a resize. While a
step's body runs, a collective that fails because a peer was lost does not raise: it marks
the epoch broken and returns NaN (dtm/runtime/process_group.py), so the body ends at once;
the loop then resizes and yields the same step again. A resize:

1. carries the snapshots this rank holds (its own pieces and its peers' replicas) out of
   the closing epoch, which ends its data connections and store;
2. rejoins through the coordinator, which publishes the next epoch's view and shape (DP
   gives way first, by `dtm launch --give-way`), and connects to the new members;
3. reshapes every process mesh that `state`'s tensors live on, and agrees on the newest
   snapshot every survivor holds (a joiner holds none; it receives every piece it needs
   from its peers' store parts over the wire);
4. loads `state` from it, laid out on the new mesh (dtm.checkpoint.load "mem://"); with no
   such snapshot, from the checkpoint directory given as `checkpoint`, the last resort.

When the coordinator itself is lost, the boundary's agreement says so, rank 0 runs its
successor (the job's policy from DTM_ELASTIC*, which `dtm launch --elastic` sets) and
every rank reconnects to it in step 2; the mesh keeps its shape unless a rank is gone too.

The log says which source each resize used and how long it took. A rank the new shape has
no place for ends (exit status 0); a resize that cannot complete ends every rank with E1010
naming the ranks and the step.

Layer: row 8 (dtm/elastic), beside dtm/ckpt, on the runtime's process group (row 7).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import ckpt
from ..ckpt import manifest as mf
from ..ckpt.snapshot import URL as MEMORY, adopt, carry, publish, snapshot, snapshots
from ..cluster.env import elastic_env
from ..cluster.resize import ElasticCoordinator
from ..errors import DTMError, ErrorCode as E
from ..runtime import process_group

log = logging.getLogger("dtm.elastic")

RESIZE_TIMEOUT_S = 60.0  # a rank's whole rejoin: the coordinator's own bound (30 s) and then some


@dataclass(frozen=True)
class Resized:
    """What a resize did, for logs and benchmarks: the epoch, the mesh axes, the step the
    loop went back to, where the state came from and how long it took (seconds)."""

    epoch: int
    axes: tuple
    step: int
    source: str
    seconds: float
    why: str

    def __repr__(self) -> str:
        return (f"Resized(epoch={self.epoch}, axes={dict(self.axes)}, step={self.step}, source={self.source!r}, "
                f"seconds={self.seconds:.3f}, why={self.why!r})")


history: list[Resized] = []  # this process's resizes, oldest first


def steps(state: dict, total: int, snapshot_every: int = 1, *, start: int = 0, checkpoint: str | None = None,
          replicas: int = 1, resize_timeout: float = RESIZE_TIMEOUT_S) -> Iterator[int]:
    """Yield the step numbers `start` to `total - 1` of a training loop over `state` (as
    dtm.checkpoint.save takes it), resizing the mesh in between as the module doc says. In
    a process of its own (no mesh of several processes) it yields the steps and does nothing
    else."""
    if not isinstance(snapshot_every, int) or isinstance(snapshot_every, bool) or snapshot_every < 1:
        raise DTMError(E.ATTRIBUTE_VALUE, f"elastic.steps: snapshot_every is an int >= 1, not {snapshot_every!r}")
    pg = process_group.current() if process_group.is_initialized() else None
    if pg is None or pg.membership is None:
        yield from range(start, total)
        return
    step = start
    if pg.joined_running:  # a rank admitted into a running mesh: the state comes from the peers
        step = _take_state(state, pg, [], step, "joined the running mesh", time.perf_counter())
    while step < total:
        successor = None
        try:
            if step % snapshot_every == 0 and step not in snapshots():
                snapshot(state, replicas=replicas, step=step).wait()
            kind = _agree(pg)
            if kind in (JOIN, GONE) and step not in snapshots():  # the live state, as of now
                snapshot(state, replicas=replicas, step=step).wait()
            if kind == GONE:
                successor = _succession(pg, step)
            why = _why(pg, kind, successor)
        except DTMError as e:
            if e.code not in (E.PEER_LOST, E.COLLECTIVE_ABORTED, E.SNAPSHOT_FAILED):
                raise
            kind, why = LOSS, f"at the boundary of step {step}: {e.message}"
        if kind is None:
            pg.poison = True
            try:
                yield step
            finally:
                pg.poison = False
            if pg.broken is None:
                step += 1
                continue
            kind, why = LOSS, f"step {step} lost a peer: {pg.broken}"
        step = _resize(state, pg, step, kind == LOSS, why, checkpoint, resize_timeout, successor)


# What a boundary's flag says; the largest wins: a loss's resize takes the joiners too, and
# with the coordinator gone no resize happens before its successor runs.
JOIN, LOSS, GONE = 1, 2, 3


def _why(pg: process_group.ProcessGroup, kind: int | None, successor: tuple[str, int] | None) -> str:
    """What the log says a boundary's resize is for (nothing when there is none)."""
    m = pg.membership
    if kind == LOSS:
        return "a rank was lost"
    if kind == GONE:
        return (f"the coordinator was lost ({m.coordinator_gone or 'heard by a peer'}); its successor runs at "
                f"{successor[0]}:{successor[1]}")
    return f"ranks wait to join ({m.resize_pending or 'heard by a peer'})" if kind == JOIN else ""


def _agree(pg: process_group.ProcessGroup) -> int | None:
    """Whether any rank heard of a resize: one all_reduce(max) of this rank's flag (GONE,
    LOSS, JOIN or 0), so that every rank resizes at the same boundary. None when none did."""
    m = pg.membership
    mine = GONE if m.coordinator_gone is not None else LOSS if m.lost else JOIN if m.resize_pending else 0
    flag = int(pg.all_reduce(np.array([mine], np.int32), "max")[0])
    return flag or None


def _succession(pg: process_group.ProcessGroup, step: int) -> tuple[str, int]:
    """The coordinator is lost (every rank agreed at this boundary): rank 0 starts its
    successor from the view of this epoch and the job's policy (DTM_ELASTIC*), and every
    rank learns where it listens: one broadcast from rank 0 of an i64, the port (0: rank 0
    knows no policy, and the job ends). Spec 9.6.7, "Succession"."""
    view = pg.membership.view
    port = 0
    if pg.rank == 0:
        policy = elastic_env()
        if policy is not None:
            coordinator = ElasticCoordinator.successor(view, pg.token, policy, host=view.members[0].host,
                                                       host_rank=0).start()
            if pg.coordinator is not None:  # (one this rank ran for a mesh that never resized)
                pg.coordinator.stop()
            pg.coordinator, port = coordinator, coordinator.address[1]
            log.warning("rank 0: the coordinator of epoch %d is lost; this rank runs its successor at %s:%d",
                        view.epoch, *coordinator.address)
    port = int(pg.broadcast(np.array([port], np.int64), src=0)[0])
    if port == 0:
        raise _coordinator_lost(pg, step)
    return view.members[0].host, port


def _resize(state: dict, pg: process_group.ProcessGroup, step: int, loss: bool, why: str, checkpoint: str | None,
            timeout: float, successor: tuple[str, int] | None = None) -> int:
    """One resize (the module doc's four points), through the coordinator at `successor`
    when the job's own is lost; the step the loop goes on from."""
    t0 = time.perf_counter()
    was = (pg.epoch, pg.rank, dict(pg.axes))
    log.warning("rank %d: resizing the mesh of epoch %d at step %d: %s", pg.rank, pg.epoch, step, why)
    try:
        carried = _carry(pg, loss)
        pg.reform(timeout, successor)
    except DTMError as e:
        if e.code is E.JOIN_REFUSED:  # the new shape has no place for this rank: it is not needed
            log.warning("rank %d of epoch %d: %s; this rank ends", was[1], was[0], e.message)
            raise SystemExit(0) from None
        raise _failed(e, pg, step, "re-forming the mesh") from None
    return _take_state(state, pg, carried, step, why, t0, checkpoint)


def _carry(pg: process_group.ProcessGroup, loss: bool) -> list:
    """The snapshots this rank takes into the next epoch (dtm.ckpt.snapshot.carry). After a
    loss the next shape may have no place for some survivors (they end), so every survivor
    publishes its own blobs and the lowest one fetches every blob it lacks through the old
    epoch's store (its data connections may be mid-collective). The others keep their
    parts open until then: the new view, which ends the old epoch, comes only once every
    survivor rejoined, the lowest one after its fetch."""
    m = pg.membership
    if loss and not m.lost:
        m.wait_lost(m.detection_bound)  # (a peer's flag told this rank before the coordinator did)
    if not m.lost:
        return carry()
    survivors = tuple(r for r in range(pg.world_size) if r not in m.lost and r not in m.left)
    publish()
    return carry(everything=pg.rank == survivors[0])


def _take_state(state: dict, pg: process_group.ProcessGroup, carried: list, step: int, why: str, t0: float,
                checkpoint: str | None = None) -> int:
    """Reshape `state`'s process meshes to the new view's and load it from the newest
    snapshot the survivors hold (or `checkpoint`); the step it is of."""
    for mesh in _process_meshes(state, pg):
        mesh.resize(pg.axes or ((mesh.axis_names[0], pg.world_size),))
    try:
        try:
            step = adopt(carried)
            ckpt.load(state, MEMORY)
            source = f"the in-memory snapshot of step {step}"
        except DTMError as e:
            if e.code is not E.NO_SNAPSHOT or checkpoint is None:
                raise
            log.warning("rank %d: %s; loading the checkpoint under %s", pg.rank, e.message, checkpoint)
            ckpt.load(state, checkpoint)
            step = _checkpoint_step(checkpoint)
            source = f"the checkpoint of step {step} under {checkpoint} (no snapshot: {e.message})"
    except DTMError as e:
        raise _failed(e, pg, step, "moving the state onto the new mesh") from None
    took = time.perf_counter() - t0
    history.append(Resized(pg.epoch, tuple(pg.axes), step, source, took, why))
    log.warning("rank %d: epoch %d, mesh %s: state from %s in %.3f s; going on from step %d", pg.rank, pg.epoch,
                dict(pg.axes) or pg.world_size, source, took, step)
    return step


def _process_meshes(state: dict, pg: process_group.ProcessGroup) -> list[Any]:
    """The distinct process meshes (of `pg`) that the tensors of `state` live on."""
    found: dict[int, Any] = {}

    def take(_name: str, x: Any) -> None:
        mesh = getattr(x, "device_mesh", None)
        if mesh is not None and mesh.process is pg:
            found.setdefault(id(mesh), mesh)

    mf.encode_state(state, take)
    return list(found.values())


def _checkpoint_step(path: str) -> int:
    return ckpt.list(path)[-1].step


def _coordinator_lost(pg: process_group.ProcessGroup, step: int) -> DTMError:
    """E1010 for a job whose coordinator is gone and whose rank 0 cannot run a successor:
    it was not told the job's policy (DTM_ELASTIC, which `dtm launch --elastic` sets)."""
    m = pg.membership
    gone = m.coordinator_gone or "a peer heard it"
    return DTMError(E.RESIZE_FAILED, f"at step {step}: {m.coordinator} is gone ({gone}) and rank 0 cannot run its "
                    "successor: it was not told the job's elastic policy (DTM_ELASTIC=MIN:MAX, which `dtm launch "
                    f"--elastic` sets); rank {pg.rank} of {pg.world_size} (epoch {pg.epoch}) ends here; resume "
                    "from the last checkpoint")


def _failed(e: DTMError, pg: process_group.ProcessGroup, step: int, during: str) -> DTMError:
    """E1010 naming the ranks and the step, for a resize that could not complete."""
    return DTMError(E.RESIZE_FAILED, f"the resize at step {step} failed while {during} (this process was rank "
                    f"{pg.rank} of {pg.world_size}, epoch {pg.epoch}): {e}")


__all__ = ["steps", "history", "Resized"]
