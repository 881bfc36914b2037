"""The shared-memory transport: ranks on one host move collective data through a shared
segment per group, and point-to-point frames through a channel per pair
(`dtm.comm.channel`), instead of sockets; the TCP connections stay for control frames,
for ranks on other hosts, and to learn at once when a peer dies or fails.

    transport = connect_local(rank, world_size, addresses, token, listener=listener)

A group's segment holds, for each of two alternating buffers, one slot per member and a
result slot, plus one line of counters per member and a futex word to sleep on. A round
of all_reduce is: every member copies its chunk into its slot and counts `posted`; once
all have, member i reduces slice i of the chunk over every slot, in group order, into the
result slot and counts `reduced`; once all have, every member copies the result out and
counts `consumed`. Member i never copies slice i in: only it reads that slice, from its own
buffer. That is at most one copy in and one copy out per byte, against the several kernel
copies of a socket, and the reduction is split across the members. Large results are
copied out with streaming stores (`dtm.comm.nontemporal`). Small chunks
skip the second step: every member reduces the whole chunk itself (the same operands in
the same order, so the same bits). The other buffer lets round k+1 start while slow
members still read round k.

Desync detection: the first round of each collective also publishes the member's
descriptor (its CollectiveStart) in the segment, and every member compares all of them
before it reads any data, so all raise CollectiveMismatch together.

Waits sleep on the futex in slices of `SLICE_S` and read the sockets between slices, so a
dead peer (PeerLost) or an Error from a peer ends the wait at once. Segments are made,
and their names removed, as `dtm.comm.segment` describes; on CPUs other than x86-64 the
socket algorithms run instead.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable, Sequence

import numpy as np

from ..errors import DTMError, ErrorCode as E
from ..ref import reduction
from . import segment
from .algorithms import split
from .calls import mismatch_message, same_call
from .channel import Channel, Channels
from .nontemporal import copy_out
from .tcp import TcpTransport, Connection, connect_mesh
from .transport import P2P_STREAM, CollectiveMismatch, DEFAULT_TIMEOUT_S, Handle, PeerLost

SLOT_BYTES = 1 << 20        # one member's share of a round
CHANNEL_BYTES = 1 << 20     # the ring of each point-to-point channel (one per ordered pair of ranks)
SMALL_BYTES = 32 << 10      # rounds below this are reduced by every member in full
SPILL_BYTES = 64            # a broadcast's bytes past whole slots that ride in its last round's result slot
SLICE_S = 0.05              # longest futex sleep between looks at the sockets
MIXED_WAIT_S = 0.0005       # waiting for frames of both kinds: the sockets' wait between looks at the channels
DESC_BYTES = 68 << 10       # room for one member's descriptor, but for its group list (4 bytes a member)
_MAGIC = 0x44544D53484D3031  # "DTMSHM01"
POSTED, REDUCED, CONSUMED = 0, 1, 2
LINE, SUPPORTED = segment.LINE, segment.SUPPORTED


class Workspace:
    """The shared segment of one group (see the module doc)."""

    def __init__(self, transport: "ShmTransport", ranks: tuple[int, ...], name: str, slot_bytes: int):
        self.transport, self.ranks, self.name = transport, ranks, name
        self.n, self.me = len(ranks), ranks.index(transport.rank)
        self.leader = self.me == 0
        self.round = 0
        n = self.n
        head = 64
        self.off_ctrl = head
        self.off_bell = self.off_ctrl + n * LINE
        self.off_desc = self.off_bell + LINE
        self.desc_bytes = -(-(DESC_BYTES + 4 * n) // LINE) * LINE  # whatever fits a CollectiveStart payload
        self.off_data = self.off_desc + 2 * n * self.desc_bytes
        size = self.off_data + 2 * (n + 1) * slot_bytes
        self.segment = segment.attach(name, size, create=self.leader, magic=_MAGIC,
                                      layout={"members": n, "slot bytes": slot_bytes}, await_ready=self._await)
        self.buf = self.segment.buf
        self.slot_bytes = slot_bytes
        self.ctrl = np.ndarray((n, LINE // 8), np.int64, self.buf, self.off_ctrl)
        self.bell = segment.Futex(np.ndarray((1,), np.uint32, self.buf, self.off_bell))

    # --- the segment ------------------------------------------------------------------------

    def _await(self, ready, what: str) -> None:
        op = f"setting up shared memory for group {list(self.ranks)}"
        segment.await_ready(ready, what, self.transport.timeout,
                            f"rank {self.transport.rank} ({self.name}, group {list(self.ranks)})",
                            lambda: self.transport.check_members(self.ranks, op))

    def close(self) -> None:
        self.segment.unlink()
        self.ctrl = self.bell = None  # drop the views into the segment before unmapping it
        self.segment.release()

    # --- views ----------------------------------------------------------------------------------

    def _slot(self, b: int, m: int, dtype: np.dtype, count: int) -> np.ndarray:
        """Member m's slot of buffer b (m == n: the result slot), as `count` elements."""
        off = self.off_data + (b * (self.n + 1) + m) * self.slot_bytes
        return np.ndarray((count,), dtype, self.buf, off)

    def _desc(self, b: int, m: int) -> memoryview:
        off = self.off_desc + (b * self.n + m) * self.desc_bytes
        return self.buf[off:off + self.desc_bytes]

    # --- rounds -----------------------------------------------------------------------------------

    def _wait(self, col: int, target: int, what: str) -> None:
        """Until every member's counter `col` reached `target`."""
        ctrl = self.ctrl[:, col]
        if ctrl.min() >= target:
            return
        start = last_poll = time.monotonic()
        while True:
            seen = self.bell.value()
            if ctrl.min() >= target:
                return
            now = time.monotonic()
            if now - start > self.transport.timeout:
                behind = [self.ranks[m] for m in range(self.n) if ctrl[m] < target]
                raise DTMError(E.TIMEOUT, f"{what} on rank {self.transport.rank}: waited {now - start:.1f} s in "
                               f"shared memory for ranks {behind}")
            if now - last_poll >= SLICE_S:
                self.transport.poll(what)  # PeerLost, or an Error a peer sent
                self._departed(col, target, what)
                last_poll = now
            self.bell.wait(seen, SLICE_S)

    def _departed(self, col: int, target: int, what: str) -> None:
        """PeerLost for a member this wait needs whose connection has ended. A rank that
        left with Leave ends its connection without an error the poll would raise (over TCP
        the receive posted for it does), so without this look the wait would run to its
        timeout (spec 9.6.5). Its counters are read after the ended connection was seen,
        so a member that counted before it left is not taken for one that did not."""
        for m in range(self.n):
            peer = self.ranks[m]
            gone = self.transport.ended(peer)
            if gone is not None and self.ctrl[m, col] < target:
                raise PeerLost(peer, what, gone)

    def _count(self, col: int) -> None:
        self.ctrl[self.me, col] = self.round + 1
        self.bell.ring()

    def _begin(self, what: str) -> int:
        """Start a round: its buffer is free once every member consumed the round before last."""
        self._wait(CONSUMED, self.round - 1, what)
        return self.round % 2

    def _publish(self, b: int, start: bytes) -> None:
        d = self._desc(b, self.me)
        d[:4] = len(start).to_bytes(4, "little")
        d[4:4 + len(start)] = start

    def _check(self, b: int, start: bytes, seq: int) -> None:
        """After every member posted the collective's first round: all descriptors equal."""
        for m in range(self.n):
            d = self._desc(b, m)
            theirs = bytes(d[4:4 + int.from_bytes(d[:4], "little")])
            if m != self.me and not same_call(start, theirs):
                raise CollectiveMismatch(mismatch_message(self.ranks, seq, start, self.transport.rank, theirs,
                                                          self.ranks[m]))

    def _round(self, k: int, b: int, start: bytes, what: str) -> None:
        """Post this member's data of round k and wait for everyone's (checking the
        descriptors in round 0; then the segment's name is no longer needed)."""
        if k == 0:
            self._publish(b, start)
        self._count(POSTED)
        self._wait(POSTED, self.round + 1, what)
        if k == 0:
            self._check(b, start, self._seq)
        self.segment.unlink()
        self.transport.unlink_channels()

    def _end(self) -> None:
        self._count(CONSUMED)
        self.round += 1

    def _moved(self, sent: int, received: int) -> None:
        """Count, in the transport's figures (heartbeats, `dtm launch`'s progress), the bytes
        this member put into the segment for others and took out of it from others."""
        self.transport.bytes_sent += sent
        self.transport.bytes_received += received
        self.transport.shared_bytes_sent += sent

    def _combine(self, op: str, parts: Sequence[np.ndarray], out: np.ndarray, scratch: np.ndarray | None) -> None:
        """out = parts[0] op parts[1] op ... in group order (in f32 scratch for narrow floats)."""
        acc = out if scratch is None else scratch
        if scratch is not None:
            np.copyto(acc, parts[0], casting="unsafe")
            reduction.combine(op, acc, parts[1], out=acc)
        else:
            reduction.combine(op, parts[0], parts[1], out=acc)
        for p in parts[2:]:
            reduction.combine(op, acc, p, out=acc)
        reduction.finish(op, acc, self.n, out)

    # --- the collectives ----------------------------------------------------------------------

    def run(self, kind: str, link, src: np.ndarray | None, dst: np.ndarray | None, *, op: str = "sum",
            root: int = 0) -> bool:
        self._seq = link.seq
        getattr(self, "_" + kind)(link.start, link.what, src, dst, op, root)
        return True

    def _all_reduce(self, start, what, src, dst, op, root) -> None:
        self._reduction(start, what, src, dst, op)

    def _reduce(self, start, what, src, dst, op, root) -> None:
        """all_reduce's rounds; only the root copies the result out (dst is None elsewhere)."""
        self._reduction(start, what, src, dst, op)

    def _reduction(self, start, what, src, dst, op) -> None:
        """Reduce every member's `src` into `dst` (None: this member only helps)."""
        dtype, n = src.dtype, self.n
        per = self.slot_bytes // dtype.itemsize
        narrow = reduction.work_dtype(dtype) != dtype
        small = src.nbytes <= SMALL_BYTES
        scratch = np.empty(per if small else -(-per // n), np.float32) if narrow else None
        for k in range(max(1, math.ceil(src.size / per))):
            lo, hi = k * per, min(src.size, (k + 1) * per)
            b = self._begin(what)
            mine = self._slot(b, self.me, dtype, hi - lo)
            a, z = split(hi - lo, n)[self.me]  # the slice this member reduces, when not small
            if small:
                mine[...] = src[lo:hi]
            else:  # the member's own slice is read by itself alone: it stays in src
                mine[:a], mine[z:] = src[lo:lo + a], src[lo + z:hi]
            self._round(k, b, start, what)
            slots = [self._slot(b, m, dtype, hi - lo) for m in range(n)]
            if small:
                if dst is not None:
                    self._combine(op, slots, dst[lo:hi], scratch[:hi - lo] if narrow else None)
                self._moved(mine.nbytes, (n - 1) * mine.nbytes if dst is not None else 0)
            else:
                slots[self.me] = src[lo:hi]
                result = self._slot(b, n, dtype, hi - lo)
                self._combine(op, [s[a:z] for s in slots], result[a:z], scratch[:z - a] if narrow else None)
                self._count(REDUCED)
                self._wait(REDUCED, self.round + 1, what)
                if dst is not None:
                    copy_out(dst[lo:hi], result, dst.nbytes)
                mine_part = (z - a) * dtype.itemsize  # the slice this member reduced for everyone
                # sent: its chunk but for its own slice, and that slice reduced
                self._moved(mine.nbytes, (n - 1) * mine_part + (mine.nbytes - mine_part if dst is not None else 0))
            self._end()

    def _all_gather(self, start, what, src, dst, op, root) -> None:
        dtype, count = src.dtype, src.size
        per = self.slot_bytes // dtype.itemsize
        for k in range(max(1, math.ceil(count / per))):
            lo, hi = k * per, min(count, (k + 1) * per)
            b = self._begin(what)
            self._slot(b, self.me, dtype, hi - lo)[...] = src[lo:hi]
            self._round(k, b, start, what)
            for m in range(self.n):
                if m != self.me:
                    copy_out(dst[m * count + lo:m * count + hi], self._slot(b, m, dtype, hi - lo), dst.nbytes)
            chunk = (hi - lo) * dtype.itemsize
            self._moved(chunk, (self.n - 1) * chunk)
            self._end()

    def _reduce_scatter(self, start, what, src, dst, op, root) -> None:
        narrow = reduction.work_dtype(src.dtype) != src.dtype
        scratch = np.empty(self._piece(src.dtype), np.float32) if narrow else None
        for lo, hi, pieces in self._transposed_rounds(start, what, src, dst.size):
            self._combine(op, pieces, dst[lo:hi], scratch[:hi - lo] if narrow else None)

    def _all_to_all(self, start, what, src, dst, op, root) -> None:
        count = src.size // self.n
        for lo, hi, pieces in self._transposed_rounds(start, what, src, count):
            for m, piece in enumerate(pieces):
                copy_out(dst[m * count + lo:m * count + hi], piece, dst.nbytes)

    def _piece(self, dtype: np.dtype) -> int:
        """Elements of one block per round when a slot holds a piece of each of n blocks."""
        return max(1, self.slot_bytes // (self.n * dtype.itemsize))

    def _transposed_rounds(self, start, what, src: np.ndarray, count: int):
        """Rounds in which `src` (n blocks of `count` elements) is posted piece by piece,
        piece j for member j. Yields (lo, hi, pieces): elements lo..hi of a block, as every
        member posted them for this one, in group order; valid until the next round."""
        dtype, n, per = src.dtype, self.n, self._piece(src.dtype)
        for k in range(max(1, math.ceil(count / per))):
            lo, hi = k * per, min(count, (k + 1) * per)
            b = self._begin(what)
            mine = self._slot(b, self.me, dtype, n * per)
            for j in range(n):
                mine[j * per:j * per + hi - lo] = src[j * count + lo:j * count + hi]
            self._round(k, b, start, what)
            a = self.me * per
            yield lo, hi, [self._slot(b, m, dtype, n * per)[a:a + hi - lo] for m in range(n)]
            piece = (hi - lo) * dtype.itemsize
            self._moved((n - 1) * piece, (n - 1) * piece)
            self._end()

    def _broadcast(self, start, what, src, dst, op, root) -> None:
        dtype = dst.dtype
        per = self.slot_bytes // dtype.itemsize
        rounds = max(1, math.ceil(dst.size / per))
        # A few bytes past whole slots (a checksummed broadcast's 4-byte CRC tail, spec 9.1.8)
        # ride in the last round's result slot, which a broadcast leaves unused: a tensor of
        # whole slots then takes no round more with its tail.
        spill = dst.size - (rounds - 1) * per if rounds > 1 else 0
        if spill * dtype.itemsize > SPILL_BYTES:
            spill = 0
        rounds -= 1 if spill else 0
        for k in range(rounds):
            lo, hi = k * per, min(dst.size - spill, (k + 1) * per)
            tail = spill if k == rounds - 1 else 0
            b = self._begin(what)
            chunk = (hi - lo + tail) * dtype.itemsize
            if self.me == root:
                self._slot(b, root, dtype, hi - lo)[...] = src[lo:hi]
                self._slot(b, self.n, dtype, tail)[...] = src[hi:hi + tail]
                self._moved(chunk, 0)
            self._round(k, b, start, what)
            if self.me != root:
                copy_out(dst[lo:hi], self._slot(b, root, dtype, hi - lo), dst.nbytes)
                dst[hi:hi + tail] = self._slot(b, self.n, dtype, tail)
                self._moved(0, chunk)
            self._end()

    def _barrier(self, start, what, src, dst, op, root) -> None:
        b = self._begin(what)
        self._round(0, b, start, what)
        self._end()


class ShmTransport(TcpTransport):
    """TCP connections plus, for the ranks on this host (`local`: the ranks that run here;
    None: all of them), a shared-memory workspace for each group and a channel for the
    point-to-point frames of each pair (`dtm.comm.channel`). The sockets stay for control
    frames, for ranks on other hosts, and to learn at once when a peer dies or fails."""

    def __init__(self, *args, session: str, slot_bytes: int = SLOT_BYTES, channel_bytes: int = CHANNEL_BYTES,
                 local: Sequence[int] | None = None, **kw):
        super().__init__(*args, **kw)
        self.session, self.slot_bytes = session, -(-slot_bytes // LINE) * LINE  # aligned for every dtype
        self.local = set(range(self.world_size) if local is None else local)
        self._spaces: dict[tuple[int, ...], Workspace | None] = {}
        self.shared_bytes_sent = 0  # the part of bytes_sent that went through shared memory
        self._channels: Channels | None = None
        self._channel_conns: dict[int, Connection] = {}  # peer -> its channels, read and written like a connection
        if SUPPORTED and self.rank in self.local and len(self.local) > 1:
            ranks = sorted(self.local)
            # the wait is for the creator (the lowest rank): one that left never makes it
            op = f"setting up the point-to-point channels of ranks {ranks}"
            self._channels = Channels(self.rank, ranks, f"dtm{session}_p2p_{_digest(ranks)}", channel_bytes,
                                      self.timeout, lambda: self.check_members(ranks[:1], op))
            for peer, tcp in self._conns.items():
                if peer in self.local:
                    duplex = _Duplex(self._channels.to[peer], self._channels.frm[peer])
                    self._channel_conns[peer] = Connection(peer, duplex, tcp.version, tcp.max_send, tcp.name, 0, 0)

    def check_members(self, ranks: Sequence[int], op: str) -> None:
        """Between tries of a wait for shared memory that `ranks` set up: a look at the
        sockets, and PeerLost for a member that left (it will never create or map the
        segment: as in `Workspace._departed`), not E0802 at the timeout."""
        self.poll(op)
        for peer in ranks:
            gone = self.ended(peer)
            if gone is not None:
                raise PeerLost(peer, op, gone)

    def workspace(self, ranks: tuple[int, ...]) -> Workspace | None:
        """The group's workspace; None when the group spans hosts or this CPU is not supported."""
        if ranks not in self._spaces:
            ok = SUPPORTED and len(ranks) > 1 and all(r in self.local for r in ranks)
            name = f"dtm{self.session}_{_digest(ranks)}"
            self._spaces[ranks] = Workspace(self, ranks, name, self.slot_bytes) if ok else None
        return self._spaces[ranks]

    # --- point-to-point frames through the channels ------------------------------------------

    def _conn_for(self, peer: int, stream: int) -> Connection | None:
        if stream == P2P_STREAM and peer in self._channel_conns:
            return self._channel_conns[peer]
        return super()._conn_for(peer, stream)

    def _count_sent(self, c: Connection, nbytes: int) -> None:
        super()._count_sent(c, nbytes)
        if not c.polled:  # a channel, not a socket
            self.shared_bytes_sent += nbytes

    def _progress(self, deadline: float, waiting: Iterable[Handle], op: str) -> None:
        """Move the channels' frames, then the sockets'. While it waits only for frames that
        come through a channel (point-to-point frames of a peer on this host), the rank
        sleeps on its futex word in slices of SLICE_S and looks at the sockets between them
        (PeerLost, Error); while it waits only for frames that come by socket (a peer on
        another host, or a collective's frames when its group spans hosts), on the sockets;
        for both, on the sockets in slices of MIXED_WAIT_S, looking at the channels between."""
        if self._channels is None:
            return super()._progress(deadline, waiting, op)
        waiting = list(waiting)
        seen = self._channels.bell.value()  # before looking: a write after this wakes the sleep below
        moved = self._pump(op)
        self.unlink_channels()
        now = time.monotonic()
        if moved:
            return super()._progress(now, waiting, op)  # the sockets too, without sleeping
        by_channel = [h.stream == P2P_STREAM and h.peer in self._channel_conns for h in waiting if not h.done]
        if not any(by_channel):
            writing = any(c.out for c in self._channel_conns.values())  # come back soon to push them
            return super()._progress(min(deadline, now + SLICE_S) if writing else deadline, waiting, op)
        if not all(by_channel):
            return super()._progress(min(deadline, now + MIXED_WAIT_S), waiting, op)
        super()._progress(now, waiting, op)
        if not any(h.done for h in waiting):
            self._channels.bell.wait(seen, max(0.0, min(SLICE_S, deadline - time.monotonic())))

    def unlink_channels(self) -> None:
        """Drop the channels' name once every rank mapped it (on the creator), so that a
        program of collectives alone, which never moves a channel's frames, does not keep
        it until close: a creator killed with its resource tracker would leave it behind."""
        if self._channels is not None and self._channels.segment.named:
            self._channels.unlink_when_mapped()

    def _pump(self, op: str) -> bool:
        """Write what the channels take and read what they hold; whether anything moved."""
        moved = False
        for c in self._channel_conns.values():
            if c.closed is not None:
                continue
            if c.out and self._flush(c, op):
                moved = True
            if c.sock.readable():
                self._read(c, op)
                moved = True
        return moved

    def close(self) -> None:
        for space in self._spaces.values():
            if space is not None:
                space.close()
        self._spaces.clear()
        # A Cancel may still wait in a channel: it must arrive before the Leave on the socket.
        self._push_until(lambda: not any(c.out for c in self._channel_conns.values() if c.closed is None))
        # A rank of this host that was lost (not one that left) may have created a segment
        # that is still named, and its resource tracker, which would remove it, may have
        # died with it: the mesh is over, so its names go with this rank.
        lost = any(c.closed is not None and not c.left for p, c in self._conns.items() if p in self.local)
        super().close()
        if self._channels is not None:
            self._channels.close()
            self._channels = None
        if lost:
            segment.remove_all(f"dtm{self.session}_")


class _Duplex:
    """A pair's two channels as one stream, the way `TcpTransport` uses a socket."""

    def __init__(self, out: Channel, into: Channel):
        self.sendmsg, self.recv_into, self.readable = out.sendmsg, into.recv_into, into.readable

    def fileno(self) -> int:
        return -1  # not a descriptor: the transport looks at channels itself

    def close(self) -> None:
        pass  # the segment is closed with the transport


def _digest(ranks: Sequence[int]) -> str:
    return hashlib.sha256(repr(tuple(ranks)).encode()).hexdigest()[:12]


def session_of(token: bytes | str, addresses: Sequence[tuple[str, int]], epoch: int) -> str:
    """The part of every segment name that is the mesh's: from its token, addresses and
    epoch, so two meshes on one host never share a segment (and the token cannot be read
    back from a name)."""
    secret = token.encode() if isinstance(token, str) else token
    return hashlib.sha256(secret + repr((list(map(tuple, addresses)), epoch)).encode()).hexdigest()[:16]


def remove_segments(token: bytes | str, addresses: Sequence[tuple[str, int]], epoch: int) -> list[str]:
    """Remove whatever segment names the mesh of these left in /dev/shm, and its store's
    parts (for a launcher, once all its ranks ended); the names removed."""
    return segment.remove_all(f"dtm{session_of(token, addresses, epoch)}_", dirs=True)


def connect_local(rank: int, world_size: int, addresses: Sequence[tuple[str, int]], token: bytes | str, *,
                  epoch: int = 0, timeout: float = DEFAULT_TIMEOUT_S, slot_bytes: int = SLOT_BYTES,
                  channel_bytes: int = CHANNEL_BYTES, local: Sequence[int] | None = None, **kw) -> ShmTransport:
    """`connect_mesh` for ranks of one host: the same connections, plus shared memory for
    collectives and point-to-point transfers; segment names start with `session_of`'s."""
    session = session_of(token, addresses, epoch)
    return connect_mesh(rank, world_size, addresses, token, epoch=epoch, timeout=timeout, transport_class=ShmTransport,
                        session=session, slot_bytes=slot_bytes, channel_bytes=channel_bytes, local=local, **kw)
