"""Collectives and point-to-point transfers between ranks, over any `Transport`.

    comm = Communicator(transport)
    y = comm.all_reduce(x, op="sum", group=[0, 2])      # group: global ranks, in group order

Every call takes numpy arrays of any dtype and size (0 elements included) and returns a new
array; `group` is a list of global ranks in group-rank order (None: every rank), and `src`,
`dst` are group ranks, as in spec 3.11 and 3.12.

Desync detection is always on. Before its first Data frame to a peer, each collective sends
a CollectiveStart (sequence number within the group, op, reduce op, dtype, shape, group,
root, and the caller's file:line); the receiver compares it with its own call the moment it
arrives. On a difference the detecting rank raises CollectiveMismatch naming both calls and
sends an Error to every other member, which raise it too; so no rank hangs or reduces data
of another collective. Every algorithm's messages connect all members of the group, so a
difference anywhere is seen by someone. A rank that fails for any other reason mid
collective also sends an Error, and the others raise CollectiveAborted quoting it (or
PeerLost, when what it reports is a lost peer). A rank interrupted from outside (Ctrl-C,
SystemExit) sends Cancel instead, and the others raise CollectiveAborted naming it; the
interruption itself goes on up the interrupted rank's stack. After an error the transport
is failed.

Scratch buffers (f32 partials of narrow floats, receive buffers of the ring) are kept and
reused from call to call: fresh pages cost more than the copies on a small machine.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import DTMError, ErrorCode as E
from ..ir.dtypes import DTYPES, from_numpy, numpy_dtype
from ..protocol import checksums
from ..protocol.caps import Cap
from ..protocol.errors import ProtocolError
from ..protocol.frame import FLAG_COMPRESSED, MsgType
from ..protocol.messages import Cancel, CollectiveStart, Error, P2PSend
from ..ref import reduction
from . import algorithms as alg
from .compress import check_compress, codec_for
from .calls import call_site, encode_start, group_stream, mismatch_message, same_call, seq_of
from .transport import P2P_STREAM, CollectiveAborted, CollectiveMismatch, Handle, PeerLost, Transport

SMALL_BYTES = 64 << 10      # below this, latency algorithms (recursive doubling, trees, direct)
CHUNK_BYTES = 1 << 20       # the largest Data frame of the bandwidth algorithms (see _chunk)
MAX_RECV_BYTES = 8 << 30    # the largest tensor a peer may announce to `recv`
_HISTORY = 8                # finished collectives per group whose descriptors late peers are checked against
_MAX_PENDING = 4096         # descriptors of collectives this rank has not started yet


@dataclass
class _Group:
    ranks: tuple[int, ...]
    me: int
    stream: int
    next_seq: int = 0
    calls: dict[int, bytes] = field(default_factory=dict)  # recent and current descriptors, by seq
    pending: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)  # seq -> (peer, descriptor)


class _Link:
    """One collective call on one group, as the algorithms see it: send and receive by
    group index; the CollectiveStart goes before the first Data frame to each peer."""

    def __init__(self, comm: "Communicator", g: _Group, seq: int, start: bytes, what: str):
        self.tp, self.ranks, self.stream, self.seq, self.what = comm.transport, g.ranks, g.stream, seq, what
        self.n, self.me, self.start = len(g.ranks), g.me, start
        self._start = [start]
        self._started = [False] * self.n
        self._sent = [0] * self.n
        self._received = [0] * self.n

    def send(self, to: int, buf: np.ndarray, flags: int = 0) -> Handle:
        peer = self.ranks[to]
        try:
            if not self._started[to]:
                self.tp.send(peer, self.stream, MsgType.COLLECTIVE_START, self._start)
                self._started[to] = True
            chunk = self._sent[to]
            self._sent[to] = chunk + 1
            return self.tp.send_data(peer, self.stream, buf, seq=self.seq, chunk=chunk, flags=flags)
        except PeerLost as e:
            # A peer that left after an error has usually said why (Error, Cancel): that word,
            # if it already arrived, is the better answer. Else PeerLost, naming the collective.
            self.tp.poll(self.what)
            raise PeerLost(e.peer, self.what, e.detail) from None

    def recv(self, frm: int, buf: np.ndarray, on_done: Callable[[], None] | None = None, flags: int = 0) -> Handle:
        chunk = self._received[frm]
        self._received[frm] = chunk + 1
        return self.tp.recv(self.ranks[frm], self.stream, buf, seq=self.seq, chunk=chunk, on_done=on_done,
                            flags=flags)

    def wait(self, handles: list[Handle]) -> None:
        self.tp.wait(handles, self.what)


@dataclass
class _P2PWait:
    """A recv waiting for its sender's announcement (a handle `Transport.wait` can wait on)."""

    peer: int
    expect: tuple
    out: np.ndarray | None
    kind: str = "recv"
    stream: int = P2P_STREAM  # (the announcement comes on the point-to-point stream: by channel from this host)
    done: bool = False
    result: np.ndarray | None = None
    meta: P2PSend | None = None  # the announcement it took (its `crc` is checked once the bytes landed)
    receives: list[Handle] = field(default_factory=list)


class _FromPeer(Exception):
    """Marks an error a peer reported, so it is not reported back to the group: the peer
    that sent it and its Error (which a mismatch's report passes on, `_relay`)."""

    def __init__(self, peer: int = -1, error: Error | None = None):
        super().__init__()
        self.peer, self.error = peer, error


class Communicator:
    """Collectives and point-to-point transfers over `transport` (see the module doc).
    One thread uses a Communicator at a time."""

    def __init__(self, transport: Transport, *, small_bytes: int = SMALL_BYTES, chunk_bytes: int = CHUNK_BYTES,
                 max_recv_bytes: int = MAX_RECV_BYTES):
        self.transport = transport
        self.rank, self.world_size = transport.rank, transport.world_size
        self.small_bytes, self.max_recv_bytes = small_bytes, max_recv_bytes
        self.chunk_bytes = min(chunk_bytes, transport.max_data)
        self._groups: dict[tuple[int, ...], _Group] = {}
        self._by_stream: dict[int, _Group] = {}
        self._early: dict[int, list[tuple[int, bytes]]] = {}  # descriptors for groups not formed here yet
        self._p2p_seq_out: dict[int, int] = collections.defaultdict(int)
        self._p2p_seq_in: dict[int, int] = collections.defaultdict(int)
        self._p2p_inbox: dict[int, collections.deque[P2PSend]] = collections.defaultdict(collections.deque)
        self._p2p_waiter: dict[int, _P2PWait] = {}
        self._to_self: collections.deque[tuple[P2PSend, np.ndarray]] = collections.deque()
        self._buffers: dict[tuple[int, np.dtype], np.ndarray] = {}
        self.ops_done = 0
        # all_reduce of a group that spans hosts, several ranks on one: inside each host first
        self.hierarchical = True
        transport.on_control(self._on_control)

    # --- groups -------------------------------------------------------------------------------

    def _group(self, group: Sequence[int] | None, what: str) -> _Group:
        ranks = tuple(range(self.world_size)) if group is None else tuple(int(r) for r in group)
        g = self._groups.get(ranks)
        if g is not None:
            return g
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise DTMError(E.INVALID_GROUP, f"{what}: group {list(ranks)} must list distinct ranks of the world "
                           f"(0 to {self.world_size - 1})")
        if self.rank not in ranks:
            raise DTMError(E.INVALID_GROUP, f"{what}: rank {self.rank} is not in group {list(ranks)}")
        g = _Group(ranks, ranks.index(self.rank), group_stream(ranks))
        self._groups[ranks] = g
        self._by_stream[g.stream] = g
        for peer, start in self._early.pop(g.stream, []):
            self._check_start(g, peer, start)
        return g

    def _group_rank(self, g: _Group, r: int, name: str, what: str) -> int:
        if not 0 <= r < len(g.ranks):
            raise DTMError(E.INVALID_GROUP, f"{what}: {name} {r} is not a rank of the group (0 to {len(g.ranks) - 1})")
        return r

    # --- descriptors and errors from peers ---------------------------------------------------

    def _on_control(self, peer: int, msg_type: MsgType, stream: int, payload: bytes) -> None:
        if msg_type is MsgType.COLLECTIVE_START:
            start = bytes(payload)
            g = self._by_stream.get(stream)
            if g is None:
                self._remember(self._early.setdefault(stream, []), peer, start)
            else:
                self._check_start(g, peer, start)
        elif msg_type is MsgType.P2P_SEND:
            self._p2p_arrived(peer, P2PSend.decode(payload))
        elif msg_type is MsgType.CANCEL:
            cancel = Cancel.decode(payload)
            g = self._by_stream.get(stream)
            what = (f"point-to-point transfer {cancel.seq} with this rank" if stream == P2P_STREAM else
                    f"collective #{cancel.seq} on group {list(g.ranks) if g else '?'}")
            raise CollectiveAborted(f"rank {peer} cancelled {what}: {cancel.reason}") from _FromPeer()
        elif msg_type is MsgType.ERROR:
            err = Error.decode(payload)
            code, text, reporter = err.code, err.message, err.rank if err.rank >= 0 else peer
            who = f"rank {reporter}"
            exc: DTMError
            if code == E.COLLECTIVE_MISMATCH.value:  # (passed on by whoever fails on it: _relay)
                raise CollectiveMismatch(f"{who} reported: {text}") from _FromPeer(peer, Error(code, text, reporter))
            if code == E.PEER_LOST.value:  # the same fault, whoever saw it first
                exc = PeerLost(None, "a collective", f"{who} reported: {text}")
            else:
                exc = CollectiveAborted(f"{who} failed with {code}: {text}")
            raise exc from _FromPeer()
        else:
            raise ProtocolError(E.UNEXPECTED_MESSAGE, f"a {msg_type.name} frame on an established mesh connection",
                                peer=f"rank {peer}")

    def _remember(self, into: list, peer: int, start: bytes) -> None:
        if len(into) >= _MAX_PENDING:
            raise DTMError(E.RECEIVE_BUFFER_FULL, f"rank {peer} announced more than {_MAX_PENDING} collectives this "
                           "rank has not started")
        into.append((peer, start))

    def _check_start(self, g: _Group, peer: int, theirs: bytes) -> None:
        seq = seq_of(theirs)
        if seq is None:
            CollectiveStart.decode(theirs)  # raises BAD_PAYLOAD naming what is wrong
        mine = g.calls.get(seq)
        if mine is None:
            if seq >= g.next_seq:
                self._remember(g.pending.setdefault(seq, []), peer, theirs)
            return  # older than the history kept: that collective completed on this rank
        if not same_call(mine, theirs):
            raise CollectiveMismatch(mismatch_message(g.ranks, seq, mine, self.rank, theirs, peer))

    def _report(self, g: _Group, err: DTMError) -> None:
        """Tell the group's other members why this rank's collective failed."""
        parts = Error.from_exception(err, self.rank).parts()
        peers = [r for r in g.ranks if r != self.rank]
        self.transport.notify(peers, g.stream, MsgType.ERROR, parts)

    def _relay(self, g: _Group, cause: _FromPeer) -> None:
        """Pass a mismatch's Error on to the group's members other than its reporter and
        sender, before this rank fails (spec 9.1.8). Otherwise a member that has not heard
        the reporter yet (its frames delayed, its process descheduled) could hear this rank
        leave first, and fail with E1001 for a rank that left instead of E0803: a member's
        frames reach another in order, so the Error now comes before this rank's Leave."""
        if cause.error is None:
            return
        peers = [r for r in g.ranks if r not in (self.rank, cause.peer, cause.error.rank)]
        if peers:
            self.transport.notify(peers, g.stream, MsgType.ERROR, cause.error.parts())

    def _interrupted(self, what: str, peers: Sequence[int], stream: int, seq: int, cause: BaseException) -> None:
        """This rank abandons transfer `seq` of `stream` because it was interrupted from
        outside (Ctrl-C, a signal handler's exception, ...), not because it failed: drop
        what it had not begun to send them, tell `peers` with a Cancel, fail the transport."""
        reason = f"interrupted by {type(cause).__name__}" + (f": {cause}" if str(cause) else "")
        for peer in peers:  # so the Cancel does not wait behind the rest of the data
            self.transport.discard(peer, stream)
        self.transport.notify(peers, stream, MsgType.CANCEL, Cancel(seq, reason).parts())
        self.transport.fail(CollectiveAborted(f"{what} on rank {self.rank} was interrupted by "
                                              f"{type(cause).__name__}"))

    # --- running one collective ----------------------------------------------------------------

    def _run(self, g: _Group, op: str, x: np.ndarray, body: Callable[[_Link], None], *, reduce_op: str = "",
             root: int = -1, args: str = "") -> None:
        seq = g.next_seq
        start = encode_start(seq, op, reduce_op, _dtype_name(x.dtype), x.shape, g.ranks, root, call_site(), args)
        g.next_seq += 1
        g.calls[seq] = start
        g.calls.pop(seq - _HISTORY, None)
        what = f"{op} #{seq} on group {list(g.ranks)}"
        try:
            self.transport.check_usable(what)
            for peer, theirs in g.pending.pop(seq, []):
                self._check_start(g, peer, theirs)
            if len(g.ranks) > 1:
                body(_Link(self, g, seq, start, what))
        except Exception as e:  # this rank failed it: an Error tells the group why
            err = e if isinstance(e, DTMError) else CollectiveAborted(f"{what} on rank {self.rank} failed with "
                                                                     f"{type(e).__name__}: {e}")
            if isinstance(e.__cause__, _FromPeer):
                self._relay(g, e.__cause__)
            elif not isinstance(e, CollectiveAborted):
                self._report(g, err)
            self.transport.fail(err)
            raise
        except BaseException as e:  # interrupted from outside (Ctrl-C, exit): a Cancel, and on it goes
            self._interrupted(what, [r for r in g.ranks if r != self.rank], g.stream, seq, e)
            raise
        self.ops_done += 1

    def _chunk(self, dtype: np.dtype, nbytes: int, parts: int) -> int:
        """Elements per Data frame when `nbytes` move as `parts` blocks: half a block, so
        chunks pipeline, but between 256 KiB (or chunk_bytes if smaller) and chunk_bytes
        (fewer frames, less per-frame work; 512 KiB frames were slower at 16 and 64 MiB)."""
        least = min(256 << 10, self.chunk_bytes)
        size = min(self.chunk_bytes, max(least, nbytes // max(1, parts) // 2))
        return max(1, size // max(1, dtype.itemsize))

    # --- the collectives ------------------------------------------------------------------------

    def all_reduce(self, x: np.ndarray, op: str = "sum", group: Sequence[int] | None = None, *,
                   out: np.ndarray | None = None, compress: str | None = None) -> np.ndarray:
        """Every member gets the elementwise reduction of all members' `x`, in a new array
        or in `out` (which may be `x` itself: in place). `compress` ("q8_0", "bf16",
        "auto"): chunks travel compressed (spec 9.5.1; see `_compression`)."""
        x = np.asarray(x, order="C")  # not ascontiguousarray: that makes a 0-d x 1-d
        reduction.check_reducible(x.dtype, op, "all_reduce")
        g = self._group(group, "all_reduce")
        out = self._out(out, x, "all_reduce")
        compress = self._compression(g, compress, x.dtype, op, "all_reduce")
        if compress is not None:
            return self._compressed_all_reduce(g, x, op, out, compress)
        # small ones run flat: one round between hosts either way, and fewer calls
        big = x.size * reduction.work_dtype(x.dtype).itemsize > self.small_bytes
        hosts = self._hosts(g) if big else None
        if hosts is not None:
            return self._hierarchical_all_reduce(g, hosts, x, op, out)
        flat, n = out.reshape(-1), len(g.ranks)
        work = self._work(x, flat)

        def body(link: _Link) -> None:
            if self._shared(g, "all_reduce", link, x.reshape(-1), flat, op=op):
                return
            step = self._chunk(work.dtype, work.nbytes, n)
            if work.nbytes <= self.small_bytes or work.size < n:
                alg.recursive_doubling(link, work, op, step, self._scratch(0, work.dtype, work.size))
                reduction.finish(op, work, n, flat)
            else:
                self._ring(link, alg.split(work.size, n), step, work=work, op=op, out=flat, own=1, mode="all_reduce")

        self._run(g, "all_reduce", x, body, reduce_op=op)
        if n == 1:
            reduction.finish(op, work, 1, flat)
        return out

    # --- hierarchical: inside each host, then between hosts (spec 9.5.2) -------------------------

    def _hosts(self, g: _Group) -> list[tuple[int, ...]] | None:
        """The group's ranks by host (the transport's `nodes`), each host's in group order,
        hosts in the order of their first member; None where a flat algorithm is the one to
        run: every member on one host, or each on its own, or hosts unknown, or
        `hierarchical` off."""
        nodes = self.transport.nodes
        if not self.hierarchical or nodes is None:
            return None
        by_host: dict[str, list[int]] = {}
        for r in g.ranks:
            by_host.setdefault(nodes[r], []).append(r)
        if len(by_host) < 2 or len(by_host) == len(g.ranks):
            return None
        return [tuple(h) for h in by_host.values()]

    def _hierarchical_all_reduce(self, g: _Group, hosts: list[tuple[int, ...]], x: np.ndarray, op: str,
                                 out: np.ndarray) -> np.ndarray:
        """all_reduce as collectives of subgroups (spec 9.5.2), so that each host's data
        crosses the network once each way, where a flat ring over all n members carries
        2(n-1)/n of it over the link of every host. When every host holds R members (and
        the tensor at least R elements): reduce_scatter inside each host (shared memory),
        each member's block all-reduced with the members of its index on the other hosts
        (R exchanges between hosts at once, each of 1/R of the data), all_gather inside.
        Otherwise: reduce to each host's first member, all_reduce among those, broadcast
        inside. The partials stay in the work dtype (f32 for narrow floats; avg as sum) and
        `finish` rounds once, the same way on every rank, so every member's result is
        bitwise the same."""
        try:
            return self._in_subgroups(hosts, x, op, out)
        except DTMError as e:
            # A member that failed a subgroup's collective told that subgroup; the others of
            # the whole group may wait for it in another subgroup's: tell them too.
            if not isinstance(e.__cause__, _FromPeer) and not isinstance(e, CollectiveAborted):
                self._report(g, e)
            raise

    def _in_subgroups(self, hosts: list[tuple[int, ...]], x: np.ndarray, op: str, out: np.ndarray) -> np.ndarray:
        local = next(h for h in hosts if self.rank in h)
        inner, wd, n = "sum" if op == "avg" else op, reduction.work_dtype(x.dtype), sum(map(len, hosts))
        part = x.reshape(-1).astype(wd, copy=False)  # may view `x`: never written
        per = len(local)
        if all(len(h) == per for h in hosts) and x.size >= per:
            size = -(-x.size // per) * per
            if size != x.size:  # zeros past the end, dropped at the end
                part = np.concatenate([part, np.zeros(size - x.size, wd)])
            mine = self.reduce_scatter(part, inner, 0, group=local)
            i = local.index(self.rank)
            self.all_reduce(mine, inner, group=[h[i] for h in hosts], out=mine)
            if size == x.size and wd == x.dtype and op != "avg":  # nothing left to do but gather: into `out`
                self.all_gather(mine, 0, group=local, out=out.reshape(-1))
            else:
                reduction.finish(op, self.all_gather(mine, 0, group=local)[:x.size], n, out.reshape(-1))
            return out
        if per > 1:
            part = self.reduce(part, 0, inner, group=local)
        if self.rank == local[0]:  # in place in reduce's result, not in `x`
            part = self.all_reduce(part, inner, group=[h[0] for h in hosts], out=part if per > 1 else None)
        if per > 1:
            part = self.broadcast(part if self.rank == local[0] else np.empty(x.size, wd), 0, group=local)
        reduction.finish(op, part, n, out.reshape(-1))
        return out

    # --- compressed collectives (spec 9.5.1) -----------------------------------------------------

    def _compression(self, g: _Group, compress: str | None, dtype: np.dtype, op: str | None,
                     what: str) -> str | None:
        """The encoding a collective's chunks travel in, or None. A compressed collective
        needs every member of the group to have announced CAP_QUANT (this rank included):
        else E1006 naming those that did not, unless `compress` is "auto", which then
        sends uncompressed (every member decides alike: each knows every member's Hello).
        "auto" among members that all announced it is q8_0."""
        compress = check_compress(compress, dtype, op, what)
        if compress is None or len(g.ranks) == 1:
            return None if compress is None else ("q8_0" if compress == "auto" else compress)
        tp = self.transport
        lacking = [r for r in g.ranks if r != self.rank and (c := tp.peer_caps(r)) is not None and not c & Cap.QUANT]
        own = tp.own_caps()
        if own is not None and not own & Cap.QUANT:
            lacking.insert(0, self.rank)
        if not lacking:
            return "q8_0" if compress == "auto" else compress
        if compress == "auto":
            return None
        names = ", ".join("this rank (rank %d)" % r if r == self.rank else tp.peer_name(r) for r in lacking)
        raise DTMError(E.MISSING_CAPABILITY, f"{what} with compress={compress!r} over group {list(g.ranks)}: "
                       f"{names} did not announce CAP_QUANT in its Hello, so it cannot take compressed chunks; "
                       "pass compress='auto' to send uncompressed to such groups, or compress=None")

    def _compressed_ring(self, link: _Link, bounds: list[tuple[int, int]], work: np.ndarray, own: int, mode: str,
                         compress: str) -> None:
        codec = codec_for(compress)
        n = link.n
        step = max(32, self._chunk(work.dtype, work.nbytes, n) // 32 * 32)
        received, encoded = alg.compressed_arenas(n, link.me, bounds, step, own, mode, codec.chunk_bytes)
        recv_arena, send_arena = self._scratch(6, np.uint8, received), self._scratch(7, np.uint8, encoded)
        left, right = link.ranks[(link.me - 1) % n], link.ranks[(link.me + 1) % n]
        first, plan = alg.ring_schedule(n, link.me, bounds, step, own, mode)
        if self.transport.compressed_ring_pass(left, right, link.stream, link.seq, link.start, work, first, plan,
                                               codec, mode, link.what, recv_arena, send_arena):
            return  # the same frames and bits, in C (TCP's ring pump with the codec inside)
        alg.compressed_ring(link, bounds, step, codec, work=work, own=own, mode=mode, recv_arena=recv_arena,
                            send_arena=send_arena, flags=FLAG_COMPRESSED,
                            who=f"compressed {mode} from {self.transport.peer_name(left)}")

    def _compressed_all_reduce(self, g: _Group, x: np.ndarray, op: str, out: np.ndarray, compress: str) -> np.ndarray:
        """Ring reduce-scatter with a rounding per hop, then an all-gather of the encoded
        finished blocks; blocks of the ring start at multiples of 32 elements."""
        n, size = len(g.ranks), x.size
        flat = out.reshape(-1)
        if x.dtype == np.float32:  # the values stay in `out` itself (no copy at all when in place)
            work = self._work(x, flat)
        else:
            work = self._scratch(1, np.dtype(np.float32), size)
            np.copyto(work, x.reshape(-1), casting="unsafe")
        blocks = -(-size // 32)
        bounds = [(min(32 * a, size), min(32 * b, size)) for a, b in alg.split(blocks, n)]
        self._run(g, "all_reduce", x, lambda link: self._compressed_ring(link, bounds, work, 1, "all_reduce", compress),
                  reduce_op=op, args=f"compress={compress}")
        reduction.finish(op, work, n, flat)
        return out

    def reduce(self, x: np.ndarray, dst: int = 0, op: str = "sum",
               group: Sequence[int] | None = None) -> np.ndarray | None:
        """Group rank `dst` gets the reduction of all members' `x`; the others get None."""
        x = np.asarray(x, order="C")
        reduction.check_reducible(x.dtype, op, "reduce")
        g = self._group(group, "reduce")
        dst = self._group_rank(g, dst, "dst", "reduce")
        n = len(g.ranks)
        out = np.empty(x.shape, x.dtype) if g.me == dst else None
        work = self._work(x, None)

        def body(link: _Link) -> None:
            if self._shared(g, "reduce", link, x.reshape(-1), out.reshape(-1) if out is not None else None, op=op,
                            root=dst):
                return
            step = self._chunk(work.dtype, work.nbytes, n)
            if work.nbytes <= self.small_bytes or work.size < n:
                if alg.tree_reduce(link, work, op, dst, step, self._scratch(0, work.dtype, work.size)):
                    reduction.finish(op, work, n, out.reshape(-1))
                return
            # Ring reduce-scatter (block i ends on rank i), then every block goes to dst.
            bounds = alg.split(work.size, n)
            lo, hi = bounds[g.me]
            mine = np.empty(hi - lo, x.dtype)
            self._ring(link, bounds, step, work=work, op=op, out=mine, own=0, mode="reduce_scatter")
            if g.me != dst:
                link.wait(alg.send_all(link, dst, mine, step))
                return
            flat = out.reshape(-1)
            flat[lo:hi] = mine
            link.wait([h for j, (a, b) in enumerate(bounds) if j != dst
                       for h in alg.recv_all(link, j, flat[a:b], step)])

        self._run(g, "reduce", x, body, reduce_op=op, root=g.ranks[dst])
        if n == 1:
            reduction.finish(op, work, 1, out.reshape(-1))
        return out

    def _out(self, out: np.ndarray | None, x: np.ndarray, what: str) -> np.ndarray:
        if out is None:
            return np.empty(x.shape, x.dtype)
        if out.shape != x.shape or out.dtype != x.dtype:
            raise DTMError(E.SHAPE_MISMATCH if out.dtype == x.dtype else E.DTYPE_MISMATCH,
                           f"{what}: out is {out.dtype}{list(out.shape)}, the operand {x.dtype}{list(x.shape)}")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise DTMError(E.READ_ONLY_INPUT, f"{what}: out must be a writable C-contiguous array")
        return out

    def _work(self, x: np.ndarray, flat_out: np.ndarray | None) -> np.ndarray:
        """The buffer a reduction keeps its partials in, holding `x`: the output itself
        when the dtypes agree, else f32 scratch (narrow floats)."""
        wd = reduction.work_dtype(x.dtype)
        if flat_out is not None and wd == x.dtype:
            if not np.may_share_memory(flat_out, x):
                np.copyto(flat_out, x.reshape(-1))
            elif flat_out.ctypes.data != x.ctypes.data:
                raise DTMError(E.ATTRIBUTE_VALUE, "out overlaps the operand without being it")
            return flat_out
        work = self._scratch(1, wd, x.size)
        np.copyto(work, x.reshape(-1), casting="unsafe")
        return work

    def _scratch(self, slot: int, dtype: np.dtype, size: int) -> np.ndarray:
        """A reused buffer of `size` elements (slot: which of several one call needs)."""
        key = (slot, np.dtype(dtype))
        buf = self._buffers.get(key)
        if buf is None or buf.size < size:
            buf = self._buffers[key] = np.empty(size, dtype)
        return buf[:size]

    def _ring(self, link: _Link, bounds: list[tuple[int, int]], step: int, *, out: np.ndarray, own: int, mode: str,
              work: np.ndarray | None = None, op: str = "sum") -> None:
        """`algorithms.ring`, or the same pass run by the transport itself where it can
        (`Transport.ring_pass`: TCP's in C)."""
        n, me = link.n, link.me
        first, plan = alg.ring_schedule(n, me, bounds, step, own, mode)
        buf = out if mode == "all_gather" else work
        finished = None if buf is out else out  # reduce_scatter: the own block goes to `out`
        if self.transport.ring_pass(link.ranks[(me - 1) % n], link.ranks[(me + 1) % n], link.stream, link.seq,
                                    link.start, buf, first, plan, op, n, link.what, finished,
                                    alg.ring_out_base(n, me, bounds, own, mode)):
            return
        tmp = [self._scratch(2 + i, work.dtype, step) for i in range(2)] if work is not None else []
        alg.ring(link, bounds, step, work=work, op=op, out=out, own=own, mode=mode, tmp=tmp)

    def all_gather(self, x: np.ndarray, dim: int = 0, group: Sequence[int] | None = None, *,
                   compress: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Every member gets all members' `x` joined along `dim`, in group order;
        `compress`: each member's block travels encoded once (spec 9.5.1). `out`: the
        result goes there (along dim 0 only, uncompressed: the members' blocks one after
        another)."""
        x = np.asarray(x, order="C")
        dim = self._dim(dim, x.ndim, "all_gather")
        g = self._group(group, "all_gather")
        n = len(g.ranks)
        count = x.size
        if out is not None:
            if dim != 0 or compress is not None:
                raise DTMError(E.ATTRIBUTE_VALUE, "all_gather: out is for dim 0 without compress")
            out = self._out(out, np.empty((n * x.shape[0],) + x.shape[1:], x.dtype) if x.ndim else
                            np.empty(n, x.dtype), "all_gather")
        compress = self._compression(g, compress, x.dtype, None, "all_gather")
        if compress is not None and n > 1:
            work = self._scratch(1, np.dtype(np.float32), n * count)
            np.copyto(work[g.me * count:(g.me + 1) * count], x.reshape(-1), casting="unsafe")
            bounds = [(j * count, (j + 1) * count) for j in range(n)]
            self._run(g, "all_gather", x,
                      lambda link: self._compressed_ring(link, bounds, work, 0, "all_gather", compress),
                      args=f"dim={dim}, compress={compress}")
            return _join(work.astype(x.dtype).reshape((n,) + x.shape), dim)
        gathered = np.empty((n,) + x.shape, x.dtype) if out is None else out.reshape((n,) + x.shape)
        flat = gathered.reshape(-1)
        flat[g.me * count:(g.me + 1) * count] = x.reshape(-1)

        def body(link: _Link) -> None:
            if self._shared(g, "all_gather", link, x.reshape(-1), flat):
                return
            step = self._chunk(x.dtype, flat.nbytes, n)
            if flat.nbytes <= self.small_bytes:
                alg.direct_all_gather(link, flat, count, step)
            else:
                self._ring(link, [(j * count, (j + 1) * count) for j in range(n)], step, out=flat, own=0,
                           mode="all_gather")

        self._run(g, "all_gather", x, body, args=f"dim={dim}")
        return _join(gathered, dim) if out is None else out

    def reduce_scatter(self, x: np.ndarray, op: str = "sum", dim: int = 0,
                       group: Sequence[int] | None = None, *, compress: str | None = None) -> np.ndarray:
        """The reduction of all members' `x`, split along `dim` into n blocks; group rank
        i gets block i. `compress`: partial sums travel encoded, rounded once per hop;
        the owner keeps its block's last sum exact (spec 9.5.1)."""
        x = np.asarray(x, order="C")
        reduction.check_reducible(x.dtype, op, "reduce_scatter")
        dim = self._dim(dim, x.ndim, "reduce_scatter")
        g = self._group(group, "reduce_scatter")
        n = len(g.ranks)
        blocks = _blocks(x, dim, n, "reduce_scatter")  # (n, block...) contiguous
        block_shape = blocks.shape[1:]
        compress = self._compression(g, compress, x.dtype, op, "reduce_scatter")
        if compress is not None and n > 1:
            work = self._scratch(1, np.dtype(np.float32), blocks.size)
            np.copyto(work, blocks.reshape(-1), casting="unsafe")
            count = blocks.size // n
            bounds = [(j * count, (j + 1) * count) for j in range(n)]
            self._run(g, "reduce_scatter", x,
                      lambda link: self._compressed_ring(link, bounds, work, 0, "reduce_scatter", compress),
                      reduce_op=op, args=f"dim={dim}, compress={compress}")
            out = np.empty(block_shape, x.dtype)
            reduction.finish(op, work[g.me * count:(g.me + 1) * count], n, out.reshape(-1))
            return out
        count = blocks.size // n
        out = np.empty(block_shape, x.dtype)

        def body(link: _Link) -> None:
            if self._shared(g, "reduce_scatter", link, blocks.reshape(-1), out.reshape(-1), op=op):
                return
            work = self._work(blocks, None)  # only here: shared memory reads `blocks` itself
            step = self._chunk(work.dtype, work.nbytes, n)
            self._ring(link, [(j * count, (j + 1) * count) for j in range(n)], step, work=work, op=op,
                       out=out.reshape(-1), own=0, mode="reduce_scatter")

        self._run(g, "reduce_scatter", x, body, reduce_op=op, args=f"dim={dim}")
        if n == 1:
            reduction.finish(op, self._work(blocks, None), 1, out.reshape(-1))
        return out

    def broadcast(self, x: np.ndarray, src: int = 0, group: Sequence[int] | None = None) -> np.ndarray:
        """Every member gets group rank `src`'s `x` (the others pass an array of its type)."""
        x = np.asarray(x, order="C")
        g = self._group(group, "broadcast")
        src = self._group_rank(g, src, "src", "broadcast")
        tagged = len(g.ranks) > 1 and self._checksummed(g.ranks)
        if tagged:  # what moves is the tensor's bytes, then the root's CRC32C of them (spec 9.1.8)
            flat = np.empty(x.nbytes + CRC_BYTES, np.uint8)
            out = flat[:x.nbytes].view(x.dtype).reshape(x.shape)
            if g.me == src:
                _with_crc(flat, x)
        else:
            out = x.copy() if g.me == src else np.empty(x.shape, x.dtype)
            flat = out.reshape(-1)

        def body(link: _Link) -> None:
            if self._shared(g, "broadcast", link, flat, flat, root=src):
                return
            step = self._chunk(flat.dtype, flat.nbytes, 1)
            if flat.nbytes <= self.small_bytes:
                alg.tree_broadcast(link, flat, src, step)
            else:
                alg.chain_broadcast(link, flat, src, step)

        self._run(g, "broadcast", x, body, root=g.ranks[src])
        if tagged:  # the root too: its result is its copy, made after the CRC
            crc = int.from_bytes(flat[x.nbytes:].tobytes(), "little")
            root = "this rank, the root" if g.me == src else f"root {self.transport.peer_name(g.ranks[src])}"
            checksums.verify(out, crc, op="broadcast", peer=root,
                             what=f"#{g.next_seq - 1} {_dtype_name(x.dtype)}{list(x.shape)} over ranks {list(g.ranks)}")
        return out

    def all_to_all(self, x: np.ndarray, split_dim: int = 0, concat_dim: int = 0,
                   group: Sequence[int] | None = None) -> np.ndarray:
        """Block j of `x` along `split_dim` goes to group rank j; the blocks received are
        joined along `concat_dim` in the senders' group order."""
        x = np.asarray(x, order="C")
        split_dim = self._dim(split_dim, x.ndim, "all_to_all")
        concat_dim = self._dim(concat_dim, x.ndim, "all_to_all")
        g = self._group(group, "all_to_all")
        n = len(g.ranks)
        blocks = _blocks(x, split_dim, n, "all_to_all")
        received = np.empty_like(blocks)
        count = blocks.size // n

        def body(link: _Link) -> None:
            if self._shared(g, "all_to_all", link, blocks.reshape(-1), received.reshape(-1)):
                return
            alg.direct_all_to_all(link, blocks.reshape(-1), received.reshape(-1), count,
                                  self._chunk(x.dtype, blocks.nbytes, n))

        self._run(g, "all_to_all", x, body, args=f"split_dim={split_dim}, concat_dim={concat_dim}")
        if n == 1:
            received[...] = blocks
        return _join(received, concat_dim)

    def barrier(self, group: Sequence[int] | None = None) -> None:
        """Returns once every member has called it."""
        g = self._group(group, "barrier")

        def body(link: _Link) -> None:
            if not self._shared(g, "barrier", link, None, None):
                alg.dissemination_barrier(link)

        self._run(g, "barrier", np.empty(0, np.uint8), body)

    def _shared(self, g: _Group, kind: str, link: _Link, src, dst, **kw) -> bool:
        """Run collective `kind` through the transport's shared-memory workspace when it
        has one for this group (then True)."""
        ws = getattr(self.transport, "workspace", None)
        space = ws(g.ranks) if ws is not None else None
        return space is not None and space.run(kind, link, src, dst, **kw)

    @staticmethod
    def _dim(dim: int, ndim: int, what: str) -> int:
        if not -ndim <= dim < ndim:
            raise DTMError(E.ATTRIBUTE_VALUE, f"{what}: dim {dim} is out of range for a tensor of rank {ndim}")
        return dim % ndim

    # --- point-to-point ------------------------------------------------------------------------

    def send(self, x: np.ndarray, dst: int, group: Sequence[int] | None = None) -> None:
        """Send `x` to group rank `dst`. Returns once its bytes are in flight (in the
        socket's or the shared-memory channel's buffer), not when the receiver has them, so
        `x` may be changed afterwards; like torch.distributed's `send`, a large tensor waits
        for a receiver to drain it. While it waits the rank reads what its peers send, so
        two ranks that send to each other before they receive do not deadlock. Transfers
        between two ranks arrive in the order they were sent."""
        g = self._group(group, "send")
        peer = g.ranks[self._group_rank(g, dst, "dst", "send")]
        what = f"send to rank {peer}"
        data = np.ascontiguousarray(x).reshape(-1)
        dtype, where = from_numpy(data.dtype).name, call_site()
        # the CRC of the caller's own array, before any copy (spec 9.4.9)
        crc = checksums.array_crc(data) if self._checksummed([peer]) else None
        if peer == self.rank:
            self._to_self.append((P2PSend(0, 0, dtype, np.shape(x), where, crc), data.copy()))
            return
        seq = self._p2p_seq_out[peer]
        self._p2p_seq_out[peer] = seq + 1
        meta = P2PSend(seq, 0, dtype, np.shape(x), where, crc)
        tp = self.transport
        tp.check_usable(what)
        try:
            tp.send(peer, P2P_STREAM, MsgType.P2P_SEND, meta.parts())
            view = data.view(np.uint8)
            tp.wait([tp.send_data(peer, P2P_STREAM, view[a:b], seq=seq, chunk=chunk)
                     for chunk, (a, b) in enumerate(alg.chunks(0, view.size, self.chunk_bytes))], what)
        except DTMError:
            raise  # PeerLost, or the receiver's Cancel or Error: `wait` failed the transport already
        except BaseException as e:  # interrupted from outside: the receiver would wait for the rest
            self._interrupted(what, [peer], P2P_STREAM, seq, e)
            raise

    def recv(self, src: int, group: Sequence[int] | None = None, *, out: np.ndarray | None = None,
             dtype=None, shape: Sequence[int] | None = None) -> np.ndarray:
        """The oldest tensor group rank `src` sent to this rank. `out` (a contiguous array)
        or `dtype` and `shape` declare what is expected: another type is an error
        (E0402, E0403)."""
        g = self._group(group, "recv")
        peer = g.ranks[self._group_rank(g, src, "src", "recv")]
        if out is not None:
            dtype, shape = out.dtype, out.shape
        expect = (np.dtype(dtype) if dtype is not None else None, tuple(shape) if shape is not None else None)
        what = f"recv from rank {peer}"
        if peer == self.rank:
            if not self._to_self:
                raise DTMError(E.TIMEOUT, f"{what}: this rank sent nothing to itself")
            meta, data = self._to_self.popleft()
            result = _expect_type(meta, expect, what, self.max_recv_bytes, out)
            result.reshape(-1)[...] = data
            _verify_p2p(result, meta, "this rank")
            return result
        waiter = _P2PWait(peer, expect, out)
        self._p2p_waiter[peer] = waiter
        try:
            if self._p2p_inbox[peer]:
                self._p2p_arrived(peer, None)
            self.transport.wait([waiter], what)  # until the announcement: it posts the receives
            self.transport.wait(waiter.receives, what)
        except DTMError as e:  # the sender's Data frames are now unclaimed: no later recv may take them
            self.transport.fail(e)
            raise
        except BaseException as e:  # interrupted from outside (Ctrl-C, exit): the sender learns it
            transfer = self._p2p_seq_in[peer] - 1 if waiter.done else self._p2p_seq_in[peer]
            self._interrupted(what, [peer], P2P_STREAM, transfer, e)
            raise
        finally:
            self._p2p_waiter.pop(peer, None)
        _verify_p2p(waiter.result, waiter.meta, self.transport.peer_name(peer))
        return waiter.result

    def _p2p_arrived(self, peer: int, meta: P2PSend | None) -> None:
        """A P2PSend announcement arrived (or one is queued): when a recv waits for it,
        check it and post the receives of its Data frames now, so they land without a copy."""
        if meta is not None:
            want = self._p2p_seq_in[peer] + len(self._p2p_inbox[peer])
            if meta.seq != want:
                raise DTMError(E.OUT_OF_SEQUENCE, f"rank {peer} announced point-to-point transfer {meta.seq}, "
                               f"expected {want}")
            self._p2p_inbox[peer].append(meta)
        waiter = self._p2p_waiter.get(peer)
        if waiter is None or waiter.done:
            return
        meta = waiter.meta = self._p2p_inbox[peer].popleft()
        self._p2p_seq_in[peer] += 1
        waiter.result = _expect_type(meta, waiter.expect, f"recv from rank {peer}", self.max_recv_bytes, waiter.out)
        view = waiter.result.reshape(-1).view(np.uint8)
        waiter.receives = [self.transport.recv(peer, P2P_STREAM, view[a:b], seq=meta.seq, chunk=c)
                           for c, (a, b) in enumerate(alg.chunks(0, view.size, self.chunk_bytes))]
        waiter.done = True

    def _checksummed(self, ranks: Sequence[int]) -> bool:
        """Whether transfers among `ranks` carry the producer's CRC32C (spec 9.4.9): this
        rank and every other of them announced CAP_CHECKSUMS in its Hello (ranks that are
        threads of one process exchanged none: DTM_CHECKSUMS decides), so every member of
        a group decides alike."""
        tp = self.transport
        own = tp.own_caps()
        if not (checksums.enabled() if own is None else own & Cap.CHECKSUMS):
            return False
        return all((c := tp.peer_caps(r)) is None or c & Cap.CHECKSUMS for r in ranks if r != self.rank)

    def close(self) -> None:
        """Say Leave to every peer and close the transport (sends have all left by now)."""
        self.transport.close()


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = from_numpy(dtype).name
    return name


CRC_BYTES = 4  # a checksummed broadcast's tail: the root's CRC32C of the tensor, little-endian


def _with_crc(wire: np.ndarray, x: np.ndarray) -> None:
    """Fill a checksummed broadcast's bytes `wire` at its root: the bytes of the caller's
    `x`, then their CRC32C, computed from `x` itself before the copy (so the copy is covered)."""
    crc = checksums.array_crc(x)
    wire[:x.nbytes] = x.reshape(-1).view(np.uint8)
    wire[x.nbytes:] = np.frombuffer(crc.to_bytes(CRC_BYTES, "little"), np.uint8)


def _verify_p2p(result: np.ndarray, meta: P2PSend, peer: str) -> None:
    """E1008 unless a received tensor has the CRC32C its sender announced (when it announced one)."""
    if meta.crc is not None:
        checksums.verify(result, meta.crc, op="recv", peer=peer, what=f"point-to-point transfer {meta.seq} "
                         f"{meta.dtype}{list(meta.shape)} (sent at {meta.where})")


def _expect_type(meta: P2PSend, expect: tuple, what: str, limit: int, out: np.ndarray | None) -> np.ndarray:
    """The array a received tensor lands in, after checking it against the declared type."""
    if meta.dtype not in DTYPES or DTYPES[meta.dtype].is_quant:
        raise DTMError(E.DTYPE_MISMATCH, f"{what}: the sender announced dtype {meta.dtype}, which has no array form")
    dtype = numpy_dtype(DTYPES[meta.dtype])
    want_dtype, want_shape = expect
    if want_dtype is not None and want_dtype != dtype:
        raise DTMError(E.DTYPE_MISMATCH, f"{what}: expected {from_numpy(want_dtype).name}, the sender sent "
                       f"{meta.dtype}{list(meta.shape)} (at {meta.where})")
    if want_shape is not None and want_shape != meta.shape:
        raise DTMError(E.SHAPE_MISMATCH, f"{what}: expected shape {list(want_shape)}, the sender sent "
                       f"{meta.dtype}{list(meta.shape)} (at {meta.where})")
    nbytes = math.prod(meta.shape) * dtype.itemsize
    if nbytes > limit:
        raise DTMError(E.RECEIVE_BUFFER_FULL, f"{what}: the sender announced {meta.dtype}{list(meta.shape)} "
                       f"({nbytes} bytes); this rank accepts at most {limit} bytes")
    if out is not None:
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise DTMError(E.READ_ONLY_INPUT, f"{what}: `out` must be a writable C-contiguous array")
        return out
    return np.empty(meta.shape, dtype)


def _blocks(x: np.ndarray, dim: int, n: int, what: str) -> np.ndarray:
    """x split along `dim` into n equal blocks, as one contiguous (n, *block_shape) array
    (a view when dim is 0); collective `what` refuses a dim that does not divide."""
    shape = x.shape
    if shape[dim] % n:
        raise DTMError(E.SHAPE_MISMATCH, f"{what}: dim {dim} of shape {list(shape)} is not divisible by "
                       f"the group size {n}")
    pre, size, post = math.prod(shape[:dim]), shape[dim] // n, math.prod(shape[dim + 1:])
    block_shape = shape[:dim] + (size,) + shape[dim + 1:]
    grouped = x.reshape(pre, n, size * post).transpose(1, 0, 2)
    return np.ascontiguousarray(grouped).reshape((n,) + block_shape)


def _join(blocks: np.ndarray, dim: int) -> np.ndarray:
    """The n blocks of `blocks` ((n, *block_shape)) joined along `dim`."""
    n, block_shape = blocks.shape[0], blocks.shape[1:]
    if dim == 0:
        return blocks.reshape((n * block_shape[0],) + block_shape[1:])
    pre, size, post = math.prod(block_shape[:dim]), block_shape[dim], math.prod(block_shape[dim + 1:])
    joined = blocks.reshape(n, pre, size * post).transpose(1, 0, 2)
    return np.ascontiguousarray(joined).reshape(block_shape[:dim] + (n * size,) + block_shape[dim + 1:])
