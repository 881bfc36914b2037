"""`dtm launch -n N script.py [args...]`: N local ranks as subprocesses.

The launcher runs the coordinator itself (a thread; so no rank is special and a free port
is held, not guessed), or uses one given with `--coordinator` (then DTM_TOKEN must be the
token it was started with). Each rank gets DTM_COORDINATOR, DTM_RANK, DTM_WORLD_SIZE,
DTM_TOKEN (random per launch unless given) and DTM_COORDINATOR_EXTERNAL=1 in its
environment, runs in its own session (so ending it ends its children too), and has its
stdout and stderr forwarded line by line with a `[rank k] ` prefix.

When a rank fails, the launcher follows its failure policy (`on_failure`). "stop", the
default: it ends the others (SIGTERM to their process groups, SIGKILL to what is left after
`grace` seconds), says which rank failed first, and exits with that rank's status (128 +
signal when it was killed). "continue", the default of a job that declared itself elastic
(`dtm.init(elastic=True)` on any of its ranks before the failure): the others keep running
(the coordinator has declared the failed rank lost, so their collectives with it fail at
once and the mesh's store reads its keys from their replicas), the launcher waits for every
rank, names each that failed and the ones that finished, and exits with the status of the
first that failed. The rank it names first is the first the coordinator declared lost, when
the launcher runs the coordinator: a rank that hangs exits no sooner than its peers, which
fail because of it. A lost rank that never ends (stopped) counts as failed once every other
rank has ended. SIGINT or SIGTERM to the launcher ends every rank the same way. A job that
was cancelled (`dtm.cancel`, `dtm cancel`; spec 9.4.10) ends on its own: every rank's
operations fail with Cancelled, so the launcher waits for every rank, then says who
cancelled it and why and how each rank ended, and exits with the status of the first that
failed (0 when every rank caught the cancel and exited 0).

Once every rank ended, the launcher removes the shared-memory segment names their mesh left
(a rank killed together with the resource tracker that would have removed them), and the
store parts whose owner no longer runs: those of this host in its own $DTM_MESH_STORE or
/dev/shm (`leftovers.remove_orphans`), and every part a rank of this run claimed, whatever
its base (the ranks note them in the run's directory, $DTM_LAUNCH_RUN).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Union

from ..comm.shm import remove_segments
from ..errors import DTMError, ErrorCode as E
from .cancel import canceller
from . import jobfile
from .coordinator import JOIN_TIMEOUT_S, Coordinator
from .resize import ElasticCoordinator
from .env import Axes, ElasticPolicy, heartbeat_env, metrics_env, parse_address
from .leftovers import ELASTIC, RUN_ENV, note, remove_noted, remove_orphans, scratch_base
from .rank_process import exit_status, print_line, rank_command, read_lines, signal_group
from .ray_ranks import OUTPUT_WAIT_S, RayCluster, RayRank
from .metrics import DEFAULT_HOST

log = logging.getLogger("dtm.cluster")
Rank = Union["_LocalRank", RayRank]  # a rank's process as the launcher handles it

GRACE_S = 5.0
POLL_S = 0.05
STOP, CONTINUE = "stop", "continue"  # what the launcher does with the other ranks when one fails


def declare_elastic() -> None:
    """Declare this rank's job elastic: it goes on when a rank fails, so its `dtm launch`
    keeps the other ranks running (unless told `--on-failure stop`). Nothing for a rank that
    `dtm launch` did not start."""
    note(ELASTIC, "")


class _LocalRank(subprocess.Popen):
    """A rank's process on this host, in its own session: `killpg` and `status`, as a rank
    on a Ray actor (ray_ranks.RayRank) has them."""

    def killpg(self, sig: int) -> None:
        signal_group(self.pid, sig)

    def status(self) -> str:
        return exit_status(self.returncode)


class _Forward(threading.Thread):
    """Copies one pipe to `out`, line by line, each line prefixed."""

    def __init__(self, pipe: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock):
        super().__init__(daemon=True)
        self.pipe, self.out, self.prefix, self.lock = pipe, out, prefix, lock

    def run(self) -> None:
        read_lines(self.pipe, lambda line: print_line(self.out, self.lock, self.prefix, line))


def launch(argv: Sequence[str], nprocs: int, *, coordinator: str | None = None, axes: Axes = (),
           grace: float = GRACE_S, join_timeout: float = JOIN_TIMEOUT_S, stdout: IO[str] | None = None,
           stderr: IO[str] | None = None, metrics: tuple[str, int] | None = None,
           on_failure: str | None = None, elastic: tuple[int, int] | None = None, give_way: Sequence[str] = (),
           join: str | None = None, ray: str | None = None, spread: bool = False, ray_cpus: float = 1.0) -> int:
    """Run `argv` as `nprocs` ranks (see the module doc); returns the exit status. The
    coordinator's heartbeat settings come from DTM_HEARTBEAT_MS and DTM_HEARTBEAT_TIMEOUT_MS;
    its Prometheus metrics are served at `metrics` (host, port), else as DTM_METRICS_PORT and
    DTM_METRICS_HOST say, else at a free port of 127.0.0.1 (`dtm top` finds it). `on_failure`
    is "stop" or "continue"; None: continue when the job declared itself elastic, else stop.

    `elastic` (fewest, most): the launcher's coordinator resizes the mesh live (spec 9.6.7,
    `give_way` the axes that shrink first); the job goes on when a rank fails, and
    succeeds when its mesh finished, whatever ranks it lost on the way. `join`: start the
    ranks into the running elastic job whose coordinator is at HOST:PORT (its token from
    DTM_TOKEN or the job's file on this machine); they ask for no rank. With `elastic`,
    the ranks are told the policy (DTM_ELASTIC*: `elastic`, `axes` as the job's first axes,
    `give_way`), so that when the coordinator is lost their rank 0 runs its successor.

    `ray`: the ranks are Ray actors of the Ray cluster at that address ("": RAY_ADDRESS or
    a local Ray), one bundle of `ray_cpus` CPUs each, on distinct nodes with `spread`
    (ray_ranks.py); with `elastic`, a rank whose actor died is replaced by a joiner."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    command = rank_command(argv)
    if on_failure not in (None, STOP, CONTINUE):
        raise DTMError(E.ATTRIBUTE_VALUE, f"on_failure is {STOP!r} or {CONTINUE!r}, not {on_failure!r}")
    cluster = None if ray is None else RayCluster(ray or None, nprocs, cpus=ray_cpus, spread=spread)
    coord = None
    try:
        if coordinator is None and join is None:
            token = os.environ.get("DTM_TOKEN") or secrets.token_hex(16)
            heartbeat_ms, timeout_ms = heartbeat_env()
            kind, extra = (Coordinator, {}) if elastic is None else \
                (ElasticCoordinator, {"elastic": elastic, "give_way": tuple(give_way)})
            # Ray ranks reach it at the driver node's address; local ranks at loopback
            where = {} if cluster is None else {"host": cluster.host()}
            coord = kind(nprocs, token, axes=axes, join_timeout=join_timeout, heartbeat_ms=heartbeat_ms,
                         timeout_ms=timeout_ms, metrics=metrics or metrics_env() or (DEFAULT_HOST, 0), **where,
                         **extra).start()
            host, port = coord.address
        else:
            host, port = parse_address(join or coordinator, "--join" if join else "--coordinator")
            token = _job_token(join) if join else os.environ.get("DTM_TOKEN", "")
            if not token:
                raise DTMError(E.NOT_INITIALIZED, "dtm launch --coordinator needs DTM_TOKEN: the token the "
                                                  "coordinator was started with")
    except BaseException:
        if cluster is not None:
            cluster.close()
        raise
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # the ranks know the policy, so that one can run a successor when the coordinator is lost
    policy = {} if elastic is None else ElasticPolicy(*elastic, tuple(axes), tuple(give_way)).env()
    run = tempfile.mkdtemp(prefix="dtm-launch-")  # what the ranks tell the launcher (leftovers.note)
    lock = threading.Lock()
    procs: list[Rank] = []
    forwards: list[_Forward] = []
    interrupted: list[int] = []
    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old_handlers[sig] = signal.signal(sig, lambda s, _f: interrupted.append(s))
    # The ranks share this host's cores: kernel threads per rank so that together they fill
    # the cores once (OpenMP threads spinning on a busy core stall every kernel). A Ray rank
    # has its bundle's CPUs.
    threads = os.environ.get("OMP_NUM_THREADS") or \
        str(max(1, int(ray_cpus) if cluster else (os.cpu_count() or 1) // nprocs))
    ours = dict(DTM_COORDINATOR=address, DTM_TOKEN=token, DTM_COORDINATOR_EXTERNAL="1", PYTHONUNBUFFERED="1",
                OMP_NUM_THREADS=threads, **{RUN_ENV: run}, **policy)

    def start(ranks: Sequence[tuple[int, str, bool, int]]) -> None:
        """Start ranks (k, label, joins, Ray bundle); a joiner asks for no rank and no world
        size (spec 9.6.7). Ray actors are asked for all at once: each takes a second to start."""
        envs = [dict(ours) if joins else dict(ours, DTM_RANK=str(k), DTM_WORLD_SIZE=str(nprocs))
                for k, _, joins, _ in ranks]
        if cluster is not None:
            procs.extend(cluster.start([(bundle, f"[{label}] ", env) for (_, label, _, bundle), env in zip(ranks, envs)],
                                       argv, run, (stdout, stderr), lock, lambda: _declared_elastic(run)))
            return
        for (_, label, joins, _), env in zip(ranks, envs):
            env = {n: v for n, v in os.environ.items() if not (joins and n in ("DTM_RANK", "DTM_WORLD_SIZE"))} | env
            p = _LocalRank(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, start_new_session=True)
            procs.append(p)
            for pipe, out in ((p.stdout, stdout), (p.stderr, stderr)):
                forwards.append(_Forward(pipe, out, f"[{label}] ", lock))
                forwards[-1].start()

    replaced: set[int] = set()

    def replace_lost() -> None:
        """An elastic job on Ray: a joiner in the bundle of each rank whose actor died, while
        ranks still run, at most `nprocs` in all."""
        for k, p in enumerate(list(procs)):
            if p.died and k not in replaced and len(replaced) < nprocs and \
                    any(q.poll() is None for q in procs):
                replaced.add(k)
                log.warning("dtm launch: %s %s; a new rank joins in its place", f"process {k}", p.status())
                start([(len(procs), f"replacement {len(replaced)}", True, p.bundle)])

    try:
        start([(k, f"joiner {k}" if join is not None else f"rank {k}", join is not None, k) for k in range(nprocs)])
        cancelled = (lambda: coord.cancelled is not None) if coord is not None else (lambda: False)
        goes_on = (lambda: True) if elastic is not None or join is not None else \
            (lambda: cancelled() or _goes_on(on_failure, run))
        # an elastic mesh renumbers its ranks at each resize: its lost members are found by pid
        lost = {} if coord is None else coord.lost if elastic is None else _LostByPid(coord, procs)
        tend = replace_lost if cluster is not None and elastic is not None else None
        failed, went_on = _watch(procs, interrupted, lost, goes_on, tend)
    finally:
        _end(procs, grace)
        for f in forwards:
            f.join(timeout=2.0)
        for p in procs:
            if isinstance(p, RayRank):
                p.wait(timeout=2.0 + OUTPUT_WAIT_S)  # its last lines
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        if coord is not None:
            coord.stop()
            _remove_segments(coord, token)
        if cluster is not None:
            for path in cluster.close():
                log.info("dtm launch: removed %s, left behind by the ranks", path)
        _remove_parts(run)
    if interrupted:
        stderr.write(f"dtm launch: interrupted by {signal.Signals(interrupted[0]).name}; ended all {nprocs} ranks\n")
        return 128 + interrupted[0]
    if coord is not None and coord.cancelled is not None:
        by, reason = coord.cancelled
        ended = ", ".join(f"rank {k} {p.status()}" for k, p in enumerate(procs))
        stderr.write(f"dtm launch: the job was cancelled by {canceller(by)}: {reason}; {ended}\n")
    elif elastic is not None:
        return _elastic_report(coord, procs, stderr)
    elif failed:
        stderr.write(_report(procs, failed, went_on, coord.lost if coord is not None else {}) + "\n")
    if not failed:
        return 0
    stderr.flush()
    code = procs[failed[0]].returncode
    return code if code > 0 else 128 - code


def _job_token(address: str) -> str:
    """DTM_TOKEN, else the token in the file of the local job whose coordinator is `address`."""
    if os.environ.get("DTM_TOKEN"):
        return os.environ["DTM_TOKEN"]
    for job in jobfile.find():
        if job.get("coordinator") == address and job.get("token"):
            return bytes.fromhex(str(job["token"])).decode()
    raise DTMError(E.NOT_INITIALIZED, f"dtm launch --join {address}: no job on this machine has its coordinator "
                                      "there; set DTM_TOKEN to the job's token")


def _elastic_report(coord: ElasticCoordinator | None, procs: list[Rank], stderr: IO[str]) -> int:
    """An elastic job's last word: its resizes (when the launcher ran its coordinator), how
    each process ended; 0 when the mesh finished (whatever it lost on the way), else 1. A
    process ended by a signal was lost and the job went on without it; one that exited
    non-zero failed on its own (a resize that could not complete: E1010)."""
    ended = ", ".join(f"process {k} {p.status()}" for k, p in enumerate(procs))
    resizes = "; ".join(coord.resizes) if coord is not None and coord.resizes else "none"
    failed = [k for k, p in enumerate(procs) if p.returncode is not None and p.returncode > 0]
    if coord is not None and coord.error is not None:
        stderr.write(f"dtm launch: the elastic job failed: {coord.error}; resizes: {resizes}; {ended}\n")
        return 1
    if failed:
        stderr.write(f"dtm launch: the elastic job failed: process(es) {failed} exited non-zero (their errors are "
                     f"above); resizes: {resizes}; {ended}\n")
    elif coord is not None and coord.resizes:
        stderr.write(f"dtm launch: the elastic job finished after {len(coord.resizes)} resize(s): {resizes}; "
                     f"{ended}\n")
    elif coord is None and any(p.returncode for p in procs):
        stderr.write(f"dtm launch: the elastic job finished: {ended}\n")
    return 1 if failed else 0


class _LostByPid(Mapping):
    """The processes (by index in `procs`) that the coordinator declared lost, found by the
    pid each joined with: an elastic mesh renumbers its ranks at each resize. Read live (the
    coordinator's thread adds to it)."""

    def __init__(self, coord: Coordinator, procs: list[Rank]):
        self.coord, self.procs = coord, procs

    def _found(self) -> dict[int, str]:
        pids = dict(self.coord.lost_pids)
        return {k: pids[p.pid] for k, p in enumerate(self.procs) if p.pid in pids}

    def __getitem__(self, k: int) -> str:
        return self._found()[k]

    def __iter__(self):
        return iter(self._found())

    def __len__(self) -> int:
        return len(self._found())


def _declared_elastic(run: str) -> None:
    """A Ray rank on another node declared the job elastic (its actor says so): as
    `declare_elastic` would have noted in run directory `run`."""
    with open(os.path.join(run, ELASTIC), "w"):
        pass


def _goes_on(on_failure: str | None, run: str) -> bool:
    """Whether the other ranks keep running when one failed: as `on_failure` says, else when
    a rank of the job declared it elastic (`declare_elastic`) in run directory `run`."""
    if on_failure is not None:
        return on_failure == CONTINUE
    return os.path.exists(os.path.join(run, ELASTIC))


def _remove_parts(run: str) -> None:
    """Once every rank ended: the store parts of dead owners in this host's base, and those
    the ranks of this run claimed wherever they lie (noted in `run`); then `run` itself."""
    for path in remove_orphans(scratch_base()) + remove_noted(run):
        log.info("dtm launch: removed %s, left behind by the ranks", path)
    shutil.rmtree(run, ignore_errors=True)


def _report(procs: list[Rank], failed: list[int], went_on: bool, lost: Mapping[int, str]) -> str:
    """The launcher's last word on a run in which ranks `failed` (the one to name first,
    first): that it ended the others, or that they went on (`went_on`) and finished."""
    def why(k: int) -> str:
        return procs[k].status() + (f"; {lost[k]}" if k in lost else "")

    if not went_on:
        first = failed[0]
        others = [k for k in range(len(procs)) if k != first]
        return (f"dtm launch: rank {first} failed first ({why(first)}); ended the other ranks {others}" if others
                else f"dtm launch: rank {first} failed ({why(first)})")
    finished = [k for k in range(len(procs)) if k not in failed]
    failures = "; ".join(f"rank {k} failed ({why(k)})" for k in failed)
    rest = f"the other ranks {finished} went on and finished" if finished else "no rank finished"
    return f"dtm launch: {failures}; {rest} (on failure: continue)"


def _remove_segments(coord: Coordinator, token: str) -> None:
    """Once every rank ended: the shared-memory segments their mesh left named (a rank
    killed with its resource tracker before it dropped a name) go, so none outlives the run."""
    for view in getattr(coord, "views", [coord.view]):  # an elastic mesh's every epoch
        if view is None:
            continue
        addresses = [(m.host, m.port) for m in view.members]
        for name in remove_segments(token, addresses, view.epoch):
            log.info("dtm launch: removed shared memory %s that the ranks left behind", name)


def _watch(procs: list[Rank], interrupted: list[int], lost: Mapping[int, str],
           goes_on: Callable[[], bool], tend: Callable[[], None] | None = None) -> tuple[list[int], bool]:
    """Wait until every rank has ended, or one failed and `goes_on()` says that the others
    stop, or a signal came: the ranks that failed ([] when none did, or on a signal) and
    whether the others went on after a failure. A rank failed when it exited non-zero, or
    when it was declared lost (`lost`: the coordinator's, updated by its thread) and every
    rank not lost has ended; the ranks declared lost come first, in the order declared (but
    one that exited 0 without Leave), then the others that exited non-zero. `tend()`, when
    given, runs first in each look (it may start ranks: an elastic job's replacements)."""
    while not interrupted:
        if tend is not None:
            tend()
        codes = [p.poll() for p in procs]
        declared = [k for k in list(lost) if codes[k] != 0]  # list(): the coordinator's thread adds to it
        running = [k for k, code in enumerate(codes) if code is None]
        exited = [k for k, code in enumerate(codes) if code]  # non-zero: an exit code or a signal
        failed = declared + [k for k in exited if k not in declared]
        ended = all(k in declared for k in running)  # none left, or only lost ones that never end
        if failed and (exited or ended) and not goes_on():
            return failed, False
        if ended:
            return failed, bool(failed)
        time.sleep(POLL_S)
    return [], False


def _end(procs: list[Rank], grace: float) -> None:
    """SIGTERM to every live rank's process group, SIGKILL after `grace` s to what is left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            p.killpg(sig)
        deadline = time.monotonic() + wait
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
