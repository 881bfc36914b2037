"""Hosts on one machine, for tests and benchmarks of DTM across a real network (issue 33):
N network namespaces, each its own "host" (its own hostname too, through a UTS namespace,
so that DTM's node identity differs and ranks of different hosts talk TCP, not shared
memory), each joined by a veth pair to a bridge in a switch namespace of their own; nothing
of the machine's own network is touched. Each host's link is shaped on its way out: a rate
alone with `tc tbf`; a one-way delay or a loss (with a rate) with `tc netem`, which some
kernels lack (`netem_missing()` says so, and a link that needs it raises Unshapeable).
`cut(i)` drops every packet to and from host i for as long as it is held (a link that fails
and returns, for fault tests).

    with Hosts(2, link=Link(rate="10gbit", delay="50us")) as hosts:
        p = hosts.run(0, [sys.executable, "job.py"], env)     # a process on host 0
        hosts.address(1)                                      # "10.77.0.2"
        with hosts.cut(1):                                    # host 1 is unreachable ...
            time.sleep(3)                                     # ... for 3 s, then returns

`LOOPBACK_ONLY` runs one command in a namespace with only loopback (`loopback_only_missing()`
says why it cannot), for peers that probe the machine's interfaces (gloo, Ray, torchrun).
`why_not()` says why namespaces cannot be made here (not root, no `ip`/`tc`/`unshare`), for
a test to skip with. It needs root (as CI and a developer's machine have).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.77.0"  # host i is SUBNET.(i + 1)/24


class Unshapeable(RuntimeError):
    """A link asks for a shaping this kernel cannot do (netem's delay or loss without netem)."""


@dataclass(frozen=True)
class Link:
    """How each host's link is shaped on its way out: `delay` one way ("50us"), `rate`
    ("10gbit"), `loss` ("1%"); None leaves that one alone."""

    delay: str | None = None
    rate: str | None = None
    loss: str | None = None

    def qdisc(self) -> list[str]:
        """The `tc qdisc add dev DEV root ...` arguments for this shaping ([] for none)."""
        if self.delay is None and self.loss is None:
            # tbf: the bucket holds a millisecond of the rate (at least 64 KiB), packets wait at most 10 ms
            return [] if self.rate is None else ["tbf", "rate", self.rate, "burst", "1mbit", "latency", "10ms"]
        args = ["netem"]
        for name, value in (("delay", self.delay), ("rate", self.rate), ("loss", self.loss)):
            if value is not None:
                args += [name, value]
        return args


def netem_missing() -> str | None:
    """None when this kernel has the netem qdisc (delay, loss), else why not."""
    name = f"dtm-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
        _ip("link", "add", "pa", "type", "veth", "peer", "name", "pb", ns=name)
        r = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "pa", "root", "netem",
                            "delay", "1ms"], capture_output=True, text=True)
        return None if r.returncode == 0 else f"this kernel has no netem qdisc (sch_netem): {r.stderr.strip()}"
    except RuntimeError as e:
        return str(e)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def why_not() -> str | None:
    """None when hosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in ("ip", "tc", "unshare") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (iproute2, util-linux)"
    name = f"dtm-probe-{secrets.token_hex(3)}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add is not permitted here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


# A command run alone in a network namespace with only loopback (gloo, Ray and torchrun's
# agent probe or bind the machine's other interfaces otherwise): LOOPBACK_ONLY + [cmd, ...]
LOOPBACK_ONLY = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]


def loopback_only_missing() -> str | None:
    """None when a loopback-only namespace (LOOPBACK_ONLY) can be made here, else why not."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip is not installed"
    try:
        r = subprocess.run([*LOOPBACK_ONLY, "true"], capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "unshare -n did not answer within 20 s"
    return None if r.returncode == 0 else f"unshare -n is not permitted here: {r.stderr.decode().strip()}"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def _bridge_port_state(ns: str, port: str, state: str) -> None:
    # "disabled" (0): the bridge drops what arrives on the port and sends nothing out of it;
    # "forwarding" (3): the normal state. Allowed by hand while the bridge runs no STP.
    number = {"disabled": "0", "forwarding": "3"}[state]
    cmd = ["bridge", "-n", ns, "link", "set", "dev", port, "state", number]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class Hosts:
    """N hosts joined by a bridge (see the module doc); a context manager that removes every
    namespace (and with them their links) and ends the processes it started."""

    def __init__(self, n: int, link: Link = Link()):
        self.n, self.link = n, link
        self.tag = secrets.token_hex(3)
        self.switch = f"dtm-sw-{self.tag}"
        self.names = [f"dtm-h{i}-{self.tag}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Hosts":
        try:
            self._make()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self._remove()

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", ns=ns)
            # the pair is made in the switch, then its host end moves into the host
            _ip("link", "add", f"s{i}", "type", "veth", "peer", "name", "eth0", ns=self.switch)
            _ip("link", "set", "eth0", "netns", ns, ns=self.switch)
            _ip("link", "set", f"s{i}", "master", "br0", ns=self.switch)
            _ip("link", "set", f"s{i}", "up", ns=self.switch)
            _ip("addr", "add", f"{self.address(i)}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            shape = self.link.qdisc()
            if shape:
                r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *shape],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    kind = Unshapeable if "unknown" in r.stderr else RuntimeError
                    raise kind(f"tc qdisc {' '.join(shape)} on host {i}: {r.stderr.strip()}")

    def _remove(self) -> None:
        for ns in [*self.names, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def address(self, i: int) -> str:
        """Host i's address on the bridge."""
        return f"{SUBNET}.{i + 1}"

    @contextmanager
    def cut(self, i: int) -> Iterator[None]:
        """Drop every packet to and from host i while the block runs, then restore its link.

        What `tc netem loss 100%` does, without netem (which some kernels lack): host i's
        port on the bridge (`s{i}` in the switch) is set to the disabled state, in which the
        bridge silently drops every frame arriving on it and forwards none to it. Both ends
        stay up and no qdisc returns an error, so each side's TCP sees only silence (its
        sends seem to leave; it retransmits with backoff) as on a cable that fails, not a
        link that goes down or a local queue that refuses. Leaving the block sets the port
        forwarding again; the sockets' own retransmissions then find the path."""
        port = f"s{i}"
        _bridge_port_state(self.switch, port, "disabled")
        try:
            yield
        finally:
            _bridge_port_state(self.switch, port, "forwarding")

    def hostname(self, i: int) -> str:
        return f"host{i}-{self.tag}"

    def run(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
            **popen) -> subprocess.Popen:
        """Start `argv` on host i (its network namespace, its own hostname)."""
        cmd = ["ip", "netns", "exec", self.names[i], "unshare", "-u", "sh", "-c", 'hostname "$0" && exec "$@"',
               self.hostname(i), *argv]
        p = subprocess.Popen(cmd, env=dict(env) if env is not None else None, **popen)
        self.procs.append(p)
        return p


__all__ = ["Hosts", "Link", "Unshapeable", "why_not", "netem_missing", "loopback_only_missing", "LOOPBACK_ONLY",
           "SUBNET"]
