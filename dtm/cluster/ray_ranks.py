"""Ranks as Ray actors: `dtm launch --ray [ADDRESS] -n N job.py` (issue 33).

Ray places and supervises the processes; DTM keeps its own wire protocol between them. The
launcher connects to the Ray cluster at ADDRESS (none: RAY_ADDRESS, else a local Ray it
starts), reserves one bundle of `cpus` CPUs per rank in a placement group (PACK, or
STRICT_SPREAD with `spread`: one rank per node), and starts one actor per rank in its bundle.
The coordinator is the launcher's own, at the driver node's address; each actor starts its
rank's command as a child process on its node (the driver's working directory when the node
has it, that node's Python), with the rank's DTM_* variables and DTM_HOST set to the node's
address, and hands the child's output back to the driver, which prints it line by line with
the `[rank k] ` prefix of a local launch.

The rank's process dies with its actor (PR_SET_PDEATHSIG, set by the thread that started it
and waits for it), so an actor that Ray loses or that is killed (`ray.kill`, a node gone) is a
rank whose connections close: the coordinator declares it lost and the launcher reports it so
("its Ray actor died"). With `--elastic` the launcher starts a new actor in the dead one's
bundle, whose rank joins the running job (spec 9.6.7, as `dtm launch --join` does); at most
N replacements in one job, so that a rank that dies at once every time cannot loop forever.

What a local launch keeps in its run directory (a rank declaring the job elastic, the store
parts the ranks claimed) is kept in a directory of the same path on each rank's node: the
actor reports the first to the driver with the output, and removes its node's parts when
its rank has ended.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
from collections import deque
from concurrent.futures import Future
from collections.abc import Mapping, Sequence
from typing import IO, Any

from ..errors import DTMError, ErrorCode as E
from .rank_process import exit_status, print_line, rank_command, read_lines, signal_group
from .leftovers import ELASTIC, remove_noted, remove_orphans, scratch_base

PLACEMENT_TIMEOUT_S = 120.0  # Ray reserving every rank's bundle (nodes may still be starting)
START_TIMEOUT_S = 120.0      # an actor starting (a fresh Ray worker process) and its rank's process
OUTPUT_WAIT_S = 0.2          # the longest an actor holds one request for its rank's output
PR_SET_PDEATHSIG = 1


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise DTMError(E.NOT_INITIALIZED, "dtm launch --ray needs Ray: pip install 'dtm[ray]'") from None
    return ray


# --- the actor's side: runs in a Ray worker process on the rank's node -----------------------

def _die_with_parent() -> None:
    """In the rank's process before exec: SIGKILL it when the thread that started it ends
    (that thread lives until the rank ends, so: when the actor's process dies)."""
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it


class RankActor:
    """One rank's process on one node, and its output until the driver takes it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.code: int | None = None
        self.run = ""
        self.lines: deque[tuple[int, str]] = deque()  # (1 stdout | 2 stderr, line)
        self.changed = threading.Condition()

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, run: str) -> tuple[int, str, str]:
        """Start the rank's process (`argv` as `rank_command` makes it, with this node's
        Python); its pid, this node's host name and its Ray node id."""
        import ray

        self.run = run
        os.makedirs(run, exist_ok=True)  # what the rank tells its launcher, on this node
        full = dict(os.environ, **env)
        full.setdefault("DTM_HOST", ray.util.get_node_ip_address())  # where its peers reach it
        started: Future = Future()

        def own() -> None:  # starts the process and lives until it ends (PR_SET_PDEATHSIG is per thread)
            try:
                proc = subprocess.Popen(rank_command(argv), env=full, cwd=cwd if os.path.isdir(cwd) else None,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True, preexec_fn=_die_with_parent)
            except OSError as e:
                return started.set_exception(e)
            started.set_result(proc)
            self._follow(proc)

        threading.Thread(target=own, daemon=True).start()
        self.proc = started.result()
        return self.proc.pid, socket.gethostname(), ray.get_runtime_context().get_node_id()

    def _follow(self, proc: subprocess.Popen) -> None:
        readers = [threading.Thread(target=self._read, args=(pipe, which), daemon=True)
                   for which, pipe in ((1, proc.stdout), (2, proc.stderr))]
        for t in readers:
            t.start()
        code = proc.wait()
        for t in readers:
            t.join()
        with self.changed:
            self.code = code
            self.changed.notify_all()

    def _read(self, pipe: IO[bytes], which: int) -> None:
        read_lines(pipe, lambda line: self._keep(which, line))

    def _keep(self, which: int, line: str) -> None:
        with self.changed:
            self.lines.append((which, line))
            self.changed.notify_all()

    def output(self, wait_s: float) -> tuple[list[tuple[int, str]], int | None, bool]:
        """The lines written since the last call (waiting up to `wait_s` for one), the
        process's exit status once it ended and every line was taken, and whether the job
        declared itself elastic."""
        with self.changed:
            self.changed.wait_for(lambda: self.lines or self.code is not None, timeout=wait_s)
            lines = list(self.lines)
            self.lines.clear()
            code = self.code
        return lines, code, os.path.exists(os.path.join(self.run, ELASTIC))

    def signal(self, sig: int) -> None:
        """`sig` to the rank's process group (SIGCONT after SIGTERM: a stopped rank handles it)."""
        if self.proc is not None and self.code is None:
            signal_group(self.proc.pid, sig)

    def clean(self) -> list[str]:
        """Once the job's ranks ended: this node's store parts that its ranks left, and the
        run's directory here; the paths removed."""
        removed = remove_orphans(scratch_base()) + remove_noted(self.run)
        shutil.rmtree(self.run, ignore_errors=True)
        return removed


# --- the driver's side: in `dtm launch` ------------------------------------------------------

class RayRank:
    """A rank on a Ray actor, handled by the launcher as it handles a local rank's process:
    `poll`, `wait`, `returncode`, `pid` (on its node), `killpg`, `status`. Its output is
    forwarded by a thread, with `prefix`."""

    def __init__(self, ray: Any, actor: Any, bundle: int, pid: int, node: str, prefix: str,
                 outs: tuple[IO[str], IO[str]], lock: threading.Lock, on_elastic):
        self.ray, self.actor, self.bundle, self.pid, self.node = ray, actor, bundle, pid, node
        self.prefix, self.outs, self.lock, self.on_elastic = prefix, outs, lock, on_elastic
        self.returncode: int | None = None
        self.died: str | None = None  # why its actor died, when it did
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._forward, daemon=True)
        self._thread.start()

    def _forward(self) -> None:
        while True:
            try:
                lines, code, elastic = self.ray.get(self.actor.output.remote(OUTPUT_WAIT_S),
                                                    timeout=OUTPUT_WAIT_S + START_TIMEOUT_S)
            except Exception as e:  # RayActorError, a lost node, GetTimeoutError: the rank is gone with it
                self.died = f"its Ray actor died: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                self.returncode = -int(signal.SIGKILL)
                break
            if elastic:
                self.on_elastic()
            for which, line in lines:
                print_line(self.outs[which - 1], self.lock, self.prefix, line)
            if code is not None:
                self.returncode = code
                break
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"{self.prefix.strip()} on {self.node}", timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def killpg(self, sig: int) -> None:
        if self.returncode is None:
            self.actor.signal.remote(int(sig))

    def status(self) -> str:
        """How it ended, for the launcher's report."""
        return self.died if self.died is not None else exit_status(self.returncode)


class RayCluster:
    """The launcher's hold on Ray: the connection, the placement group of the job's ranks'
    bundles, and their actors (see the module doc)."""

    def __init__(self, address: str | None, nprocs: int, *, cpus: float = 1.0, spread: bool = False):
        ray = self.ray = import_ray()
        from ray.util.placement_group import placement_group

        # log_to_driver off: each rank's output comes back through its actor, with its prefix;
        # a namespace of its own, where the actors are named after their ranks ("rank-1")
        self.namespace = f"dtm-{secrets.token_hex(4)}"
        ray.init(address=address, namespace=self.namespace, log_to_driver=False, configure_logging=False,
                 **({} if address or os.environ.get("RAY_ADDRESS") else {"num_cpus": max(1, int(nprocs * cpus))}))
        self.cpus, self.actors = cpus, []
        self.group = placement_group([{"CPU": cpus}] * nprocs, strategy="STRICT_SPREAD" if spread else "PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            resources = ray.cluster_resources()
            self.close()
            raise DTMError(E.TIMEOUT, f"dtm launch --ray: Ray did not place {nprocs} bundles of {cpus} CPU"
                                      f"{' on distinct nodes (--spread)' if spread else ''} in "
                                      f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {resources}")

    def host(self) -> str:
        """The driver node's address: where the ranks reach the launcher's coordinator."""
        return self.ray.util.get_node_ip_address()

    def start(self, ranks: Sequence[tuple[int, str, Mapping[str, str]]], argv: Sequence[str], run: str,
              outs: tuple[IO[str], IO[str]], lock: threading.Lock, on_elastic) -> list[RayRank]:
        """Ranks, (bundle, prefix, env) each, on actors named after their prefixes ("[rank
        1] ": "rank-1"): every actor is asked for at once (each is a new Ray worker process,
        a second or so to start), then each rank's process; DTMError when one cannot start.
        Says on `outs[1]` where each runs."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        asked = []
        for bundle, prefix, env in ranks:
            name = prefix.strip(" []").replace(" ", "-")
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle)
            actor = self.ray.remote(RankActor).options(name=name, num_cpus=self.cpus, max_concurrency=4,
                                                       scheduling_strategy=strategy).remote()
            self.actors.append(actor)
            asked.append((bundle, prefix, name, actor, actor.start.remote(list(argv), dict(env), os.getcwd(), run)))
        started = []
        for bundle, prefix, name, actor, ref in asked:
            try:
                pid, host, node_id = self.ray.get(ref, timeout=START_TIMEOUT_S)
            except Exception as e:
                raise DTMError(E.NOT_INITIALIZED, f"dtm launch --ray: {prefix.strip()} did not start on its Ray "
                                                  f"actor (bundle {bundle}): {type(e).__name__}: {e}") from None
            with lock:
                outs[1].write(f"dtm launch: {prefix.strip(' []')} runs on Ray actor {name!r} (namespace "
                              f"{self.namespace}) on node {node_id[:12]} ({host}), pid {pid}\n")
                outs[1].flush()
            started.append(RayRank(self.ray, actor, bundle, pid, host, prefix, outs, lock, on_elastic))
        return started

    def close(self) -> list[str]:
        """Every node's leftovers of the run (through the actors that live), then the actors,
        the placement group and the connection; the paths removed."""
        removed: list[str] = []
        for actor in self.actors:
            try:
                removed += self.ray.get(actor.clean.remote(), timeout=10.0)
            except Exception:  # a dead actor: its node's parts go with the next launch's remove_orphans
                pass
            self.ray.kill(actor)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)
        self.ray.shutdown()
        return removed
