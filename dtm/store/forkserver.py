"""The fork server: worker processes (ingest workers, process-task workers) are forks of a
warm image of this process, not fresh interpreters.

A fresh interpreter importing dtm costs about half a second of CPU a worker; a fork of a
process that has imported it, a few milliseconds. A worker cannot be forked from this
process once it has opened a directory store: SQLite keeps per-process lock state that a
child inherits without holding the locks (E1107 "locking protocol" when it opens the store
again). So the server is forked from this process just before its first SQLite connection
opens (`before_sqlite`, which the store calls), and forks each worker in turn; a worker
opens its own store after its fork. Where that moment has passed (inside a worker), the
server is a fresh interpreter (which imports dtm) instead.

The server answers the one process that started it, over a Unix socket: a request is one
JSON message with the worker's pipes passed as file descriptors (SCM_RIGHTS); the answer
is the worker's pid, and later one notice when the worker exits, with its status, since
only the server, the workers' parent, can reap them. Nothing is pickled. The server exits
when that socket closes, with the process that started it.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from ..errors import DTMError, ErrorCode

MAX_MESSAGE = 128 << 10  # a request: a function, a few short arguments, the environment (below the socket's buffer)
MAX_FDS = 8
SPAWN_TIMEOUT_S = 30.0   # a fork; a fresh server first imports dtm (seconds on a busy machine)
POLL_S = 0.05            # how long one reader holds the socket before others may look


class Child:
    """A worker the server forked: a `subprocess.Popen`'s pid, poll, wait, kill."""

    def __init__(self, server: _Server, pid: int):
        self._server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._wait_until(time.monotonic())

    def wait(self, timeout: float) -> int:
        """Its exit code (minus the signal that killed it); TimeoutExpired after `timeout` s."""
        code = self._wait_until(time.monotonic() + timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
        return code

    def _wait_until(self, deadline: float) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, deadline)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not a pid the system may have given to another process since
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    """This process's end of the server's socket."""

    def __init__(self, sock: socket.socket, pid: int, proc: subprocess.Popen | None = None):
        self.sock, self.pid = sock, pid
        self._proc = proc  # a fresh server's Popen, kept so that it is not collected as if abandoned
        self._exits: dict[int, int] = {}   # pid -> exit code, as the server reported them
        self._pids: list[int] = []         # answers to requests not yet taken
        self._read = threading.Lock()      # one thread reads the socket at a time
        self._spawn = threading.Lock()     # one request at a time: answers come in order

    def spawn(self, main: str, args: list[str], fds: list[int], new_session: bool) -> Child:
        """Fork a worker that calls `main` ("module:function") with the server's copies of
        `fds`, then `args`; in a session of its own if `new_session`. It gets this process's
        environment, working directory and `sys.path` as they are now, as a fresh interpreter
        would, not as they were when the server was forked."""
        request = json.dumps({"main": main, "args": args, "session": new_session, "env": dict(os.environ),
                              "cwd": os.getcwd(), "path": sys.path}).encode()
        if len(request) > MAX_MESSAGE:
            raise DTMError(ErrorCode.ATTRIBUTE_VALUE, f"a worker's environment and sys.path take {len(request)} "
                                                      f"bytes, more than the fork server's {MAX_MESSAGE}")
        with self._spawn:
            try:
                socket.send_fds(self.sock, [request], fds)
            except OSError as e:
                raise self._gone(f"cannot be sent a request ({e})") from None
            deadline = time.monotonic() + SPAWN_TIMEOUT_S
            while not self._pids:
                if time.monotonic() > deadline:
                    raise DTMError(ErrorCode.TIMEOUT, f"the fork server (pid {self.pid}) did not start a worker "
                                                      f"within {SPAWN_TIMEOUT_S:g} s")
                self._pump(deadline)
            return Child(self, self._pids.pop(0))

    def exit_code(self, pid: int, deadline: float) -> int | None:
        """`pid`'s exit code once the server reports it, else None at `deadline`."""
        while pid not in self._exits:
            if time.monotonic() >= deadline:
                return None
            self._pump(deadline)
        return self._exits[pid]

    def _pump(self, deadline: float) -> None:
        """Read what the server sent within POLL_S (at most until `deadline`)."""
        with self._read:
            wait = min(POLL_S, max(0.0, deadline - time.monotonic()))
            while select.select([self.sock], [], [], wait)[0]:
                data = self.sock.recv(MAX_MESSAGE)
                if not data:
                    raise self._gone("exited")
                msg = json.loads(data)
                if "exit" in msg:
                    self._exits[msg["exit"]] = msg["code"]
                else:
                    self._pids.append(msg["pid"])
                wait = 0.0

    def _gone(self, how: str) -> DTMError:
        return DTMError(ErrorCode.WORKER_LOST, f"the fork server (pid {self.pid}) {how}")


_server: _Server | None = None
_owner = 0            # the pid that started `_server`: a fork of this process has none
_is_worker = False    # this process is a worker the server forked
_lock = threading.Lock()


_too_late = False     # this process opened SQLite, or had threads, before a server was forked


def before_sqlite() -> None:
    """Called before SQLite opens a connection: the last moment to fork the server from this
    process. Workers never start one there (they open their store right after their fork),
    nor do other forks of a process that had one (a multiprocessing pool's): most never
    start workers, and one that does gets a fresh server."""
    global _too_late
    if not _is_worker and (_server is None or _owner == os.getpid()):
        if _single_threaded():
            server()
        _too_late = True


def _single_threaded() -> bool:
    """Whether this process runs no Python thread but this one: a fork taken while another
    Python thread holds a lock (a logging handler's, a file's buffer) could hang in the
    child, so such a process gets a fresh-interpreter server instead. (Idle C thread pools,
    OpenBLAS's and OpenMP's, are forked over as multiprocessing's fork start method does:
    their libraries reset themselves in the child.)"""
    return threading.active_count() == 1


def server() -> _Server:
    """This process's fork server, started on first use: forked from this process when it
    has no SQLite state to hand down yet and runs one thread, else a fresh interpreter."""
    global _server, _owner
    with _lock:
        if _server is None or _owner != os.getpid():
            fresh = _is_worker or _server is not None or _too_late or not _single_threaded()
            _server = _fresh() if fresh else _forked()
            _owner = os.getpid()
        return _server


def _forked() -> _Server:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        ours.close()
        _run(theirs)
    theirs.close()
    return _Server(ours, pid)


def _fresh() -> _Server:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
    code = f"import socket; from dtm.store.forkserver import _run; _run(socket.socket(fileno={theirs.fileno()}))"
    proc = subprocess.Popen([sys.executable, "-c", code],
                            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
    theirs.close()
    return _Server(ours, proc.pid, proc)


def _run(sock: socket.socket) -> None:
    """The server's life, in the forked server: never returns."""
    code = 0
    try:
        _serve(sock)
    except BaseException:  # noqa: B036 - the server's own fault: say it, then end as a process does
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)  # not the atexit handlers of the process it was forked from


def _serve(sock: socket.socket) -> None:
    """Fork a worker per request; report each worker's exit; return when the socket closes."""
    _release_inherited(keep={sock.fileno()})
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for its workers
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)  # SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    try:
        while True:
            ready = select.select([sock, wake_r], [], [], 1.0)[0]
            if wake_r in ready:
                os.read(wake_r, 4096)
            _reap(sock)
            if sock in ready:
                msg, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
                if not msg:
                    return
                pid = os.fork()
                if pid == 0:
                    _worker(json.loads(msg), fds, close=[sock.fileno(), wake_r, wake_w])
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"pid": pid}).encode())
    except (ConnectionResetError, BrokenPipeError):
        return  # the process that started it exited


def _reap(sock: socket.socket) -> None:
    """Tell the parent of each worker that exited, with its exit code."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _release_inherited(keep: set[int]) -> None:
    """Point every descriptor the server inherited (but stdio and `keep`) at /dev/null: its
    workers must not hold the parent's sockets and files open (a peer would never see them
    close), and the Python objects that still name them must not reach another file."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in map(int, os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []):
        if fd > 2 and fd not in keep and fd != null:
            try:
                os.dup2(null, fd)
            except OSError:
                pass  # the directory listing's own descriptor, closed by now
    os.close(null)


def _worker(request: dict[str, Any], fds: list[int], close: list[int]) -> None:
    """A worker's life, in the fork: call the request's function; never returns."""
    global _is_worker, _server, _lock
    code = 1
    try:
        for fd in close:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        for sig, how in ((signal.SIGCHLD, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
            signal.signal(sig, how)
        if request["session"]:
            os.setsid()
        _is_worker, _server, _lock = True, None, threading.Lock()  # the fork copied the lock held
        _fresh_stdio()
        _take_context(request)
        module, _, name = request["main"].partition(":")
        code = getattr(importlib.import_module(module), name)(fds, *request["args"]) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: B036 - a worker's fault ends it with code 1, as an interpreter's does
        traceback.print_exc()
    finally:
        for f in (sys.stdout, sys.stderr):
            f.flush()
        os._exit(code)


def _take_context(request: dict[str, Any]) -> None:
    """The requester's environment, working directory and sys.path, at its request."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[:] = request["path"]


def _fresh_stdio() -> None:
    """stdio as a fresh interpreter has it: the parent may have replaced sys.stdout (pytest's
    capture, a notebook's stream); the worker's prints go to file descriptors 1 and 2."""
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the worker's stdin for its whole life
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
