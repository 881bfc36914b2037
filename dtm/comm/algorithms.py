"""Collective algorithms over point-to-point messages: ring (bandwidth), recursive doubling
and binomial trees (latency), direct exchange (two ranks, all_to_all, small gathers).

Every function takes a `Link` (one collective call on one group: `n` members, this rank's
group index `me`, `send`/`recv`/`wait` by group index) and flat, contiguous numpy buffers;
the caller (collectives.py) turns tensors and dims into these buffers and chooses the
algorithm. Sends and receives of one (peer, group) are matched in order, so each algorithm
posts its receives in exactly the order the peer posts the matching sends.

Reduction results are bitwise equal on every rank: each element's reduction is computed
once (ring, tree) or by every rank from the same operands in the same order (recursive
doubling, direct), and narrow floats stay in f32 until `reduction.finish` rounds them once.
`tmp` arguments are the caller's scratch buffers, reused between calls (fresh pages cost
more than the copies themselves on a small machine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..ref import reduction
from .transport import Handle


class Link(Protocol):
    n: int
    me: int

    def send(self, to: int, buf: np.ndarray, flags: int = 0) -> Handle: ...
    def recv(self, frm: int, buf: np.ndarray, on_done: Callable[[], None] | None = None,
             flags: int = 0) -> Handle: ...
    def wait(self, handles: list[Handle]) -> None: ...


def split(total: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of `parts` near-equal consecutive pieces of range(total); the first
    total % parts pieces are one longer."""
    q, r = divmod(total, parts)
    out, lo = [], 0
    for p in range(parts):
        hi = lo + q + (p < r)
        out.append((lo, hi))
        lo = hi
    return out


def chunks(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into pieces of at most `step` elements; an empty range is one empty
    piece, so every message exists (and carries its descriptor) even for 0 elements."""
    if hi <= lo:
        return [(lo, lo)]
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


def send_all(link: Link, to: int, buf: np.ndarray, step: int) -> list[Handle]:
    return [link.send(to, buf[a:b]) for a, b in chunks(0, len(buf), step)]


def recv_all(link: Link, frm: int, buf: np.ndarray, step: int) -> list[Handle]:
    return [link.recv(frm, buf[a:b]) for a, b in chunks(0, len(buf), step)]


# --- all_reduce, reduce_scatter, all_gather: the pipelined ring -----------------------------

@dataclass(frozen=True)
class RingReceive:
    """One chunk a ring rank receives from its left neighbour: elements [a, b) of the
    flat buffers, in the reduce-scatter (`reduce`: combined into the work buffer; `finish`:
    on its last step, where the chunk's reduction is complete) or the all-gather;
    `forward`: passed on to the right neighbour once it has landed."""

    reduce: bool
    a: int
    b: int
    forward: bool
    finish: bool


def ring_schedule(n: int, i: int, bounds: list[tuple[int, int]], step: int, own: int,
                  mode: str) -> tuple[list[tuple[int, int]], list[RingReceive]]:
    """The chunks ring rank `i` of `n` sends first (one block, before anything arrives),
    and what it receives, in the order its left neighbour sends them: step-major, then
    chunk order. At step t of the reduce-scatter rank i receives block i+own-t-2 (mod n),
    of the all-gather block i+own-t-1. Every received chunk is passed on, except those of
    the last step (of the all-gather; of the reduce-scatter in mode "reduce_scatter")."""
    blk = lambda b: bounds[b % n]  # noqa: E731
    reduce_steps = n - 1 if mode in ("all_reduce", "reduce_scatter") else 0
    gather_steps = n - 1 if mode in ("all_reduce", "all_gather") else 0
    first = chunks(*blk(i + own - 1), step) if reduce_steps else chunks(*blk(i + own), step)
    plan = [RingReceive(True, a, b, t < reduce_steps - 1 or gather_steps > 0, t == reduce_steps - 1)
            for t in range(reduce_steps) for a, b in chunks(*blk(i + own - t - 2), step)]
    plan += [RingReceive(False, a, b, t < gather_steps - 1, False)
             for t in range(gather_steps) for a, b in chunks(*blk(i + own - t - 1), step)]
    return first, plan


def ring_out_base(n: int, i: int, bounds: list[tuple[int, int]], own: int, mode: str) -> int:
    """The element of the flat buffers that `out[0]` is: in mode "reduce_scatter" `out`
    holds only rank i's own block (i + own), else all of them."""
    return bounds[(i + own) % n][0] if mode == "reduce_scatter" else 0


def ring(link: Link, bounds: list[tuple[int, int]], step: int, *, work: np.ndarray | None = None,
         op: str = "sum", out: np.ndarray, own: int, mode: str, tmp: list[np.ndarray] = ()) -> None:
    """One pipelined ring pass over the n blocks `bounds` of the flat buffers.

    mode "all_reduce": `work` holds this rank's operand in the work dtype; a reduce-scatter
    leaves block (me + own) fully reduced here, `finish` writes it to `out`, and an
    all-gather passes every finished block around into `out`. mode "reduce_scatter": the
    same without the all-gather, `out` is block (me + own) alone. mode "all_gather": `out`
    already holds block (me + own), the all-gather fills the rest.

    Blocks are cut into chunks of `step` elements (`ring_schedule` says which), and each
    chunk moves on as soon as it arrives (and is reduced), so the reduction of one chunk
    overlaps the transfer of the next. The reduce-scatter receives into the buffers of
    `tmp` (two or more, of `step` elements of the work dtype), each re-posted as soon as
    its chunk is reduced. `work` may be `out` itself (same dtype, all_reduce in place).
    """
    n, i = link.n, link.me
    right, left = (i + 1) % n, (i - 1) % n
    out_base = ring_out_base(n, i, bounds, own, mode)
    first, plan = ring_schedule(n, i, bounds, step, own, mode)
    handles: list[Handle] = []
    free = list(tmp)
    in_place = work is out
    cursor = 0

    def post() -> None:
        nonlocal cursor
        while cursor < len(plan):
            r = plan[cursor]
            if r.reduce:
                if not free:
                    return
                buf = free.pop()
                handles.append(link.recv(left, buf[:r.b - r.a], on_done=lambda r=r, buf=buf: reduced(r, buf)))
            else:
                handles.append(link.recv(left, out[r.a:r.b], on_done=lambda r=r: gathered(r)))
            cursor += 1

    def reduced(r: RingReceive, buf: np.ndarray) -> None:
        a, b = r.a, r.b
        reduction.combine(op, buf[:b - a], work[a:b], out=work[a:b])
        free.append(buf)
        sent = work[a:b]
        if r.finish:  # block (i + own) is complete on this rank: the only place it is finished
            sent = work[a:b] if in_place else out[a - out_base:b - out_base]
            reduction.finish(op, work[a:b], n, sent)
        if r.forward:
            handles.append(link.send(right, sent))
        post()

    def gathered(r: RingReceive) -> None:
        if r.forward:
            handles.append(link.send(right, out[r.a:r.b]))

    src = work if mode != "all_gather" else out
    handles += [link.send(right, src[a:b]) for a, b in first]
    post()
    link.wait(handles)  # the callbacks append the later sends and receives to `handles`


def compressed_ring(link: Link, bounds: list[tuple[int, int]], step: int, codec, *, work: np.ndarray, own: int,
                    mode: str, recv_arena: np.ndarray, send_arena: np.ndarray, flags: int, who: str) -> None:
    """The ring of a compressed collective (spec 9.5.1): `ring`'s schedule, but every chunk
    travels as a compressed chunk of `codec` (Data frames with `flags`) and `work` (f32)
    holds the values.

    Reduce-scatter: a rank sends its chunk encoded; the receiver decodes it, adds it to its
    own (f32) and, unless the chunk is finished, encodes the sum again and forwards it, so
    a block is rounded once per hop. In mode "all_reduce" the finished block is encoded once
    more, its owner keeps the decoded values (what every other rank will get) and the
    all-gather passes the encoded bytes on unchanged, each rank decoding them into `work`.
    In mode "reduce_scatter" the owner keeps its finished block exact (f32). In mode
    "all_gather" each rank's own block is encoded once (and decoded in place, so that
    every rank holds the same values). Receives land in `recv_arena`, encodings in
    `send_arena` (bytes, large enough: `compressed_arenas`); `who` names the left
    neighbour in errors."""
    n, i = link.n, link.me
    right, left = (i + 1) % n, (i - 1) % n
    first, plan = ring_schedule(n, i, bounds, step, own, mode)
    size = codec.chunk_bytes
    handles: list[Handle] = []
    spos = 0

    def arena(count: int) -> np.ndarray:
        nonlocal spos
        buf = send_arena[spos:spos + size(count)]
        spos += size(count)
        return buf

    def landed(r: RingReceive, buf: np.ndarray) -> None:
        a, b = r.a, r.b
        codec.check(buf, b - a, who)
        if not r.reduce:
            codec.decode(buf, work[a:b])
            if r.forward:
                handles.append(link.send(right, buf, flags))
        elif r.finish and mode == "reduce_scatter":
            codec.decode_add(buf, work[a:b])
        else:
            enc = arena(b - a)
            codec.add_encode(buf, work[a:b], enc, keep=r.finish)
            if r.forward:
                handles.append(link.send(right, enc, flags))

    for a, b in first:
        enc = arena(b - a)
        codec.encode(work[a:b], enc)
        if mode == "all_gather":
            codec.decode(enc, work[a:b])
        handles.append(link.send(right, enc, flags))
    rpos = 0
    for r in plan:
        buf = recv_arena[rpos:rpos + size(r.b - r.a)]
        rpos += buf.size
        handles.append(link.recv(left, buf, on_done=lambda r=r, buf=buf: landed(r, buf), flags=flags))
    link.wait(handles)  # the callbacks append the later sends to `handles`


def compressed_arenas(n: int, i: int, bounds: list[tuple[int, int]], step: int, own: int, mode: str,
                      chunk_bytes) -> tuple[int, int]:
    """Bytes `compressed_ring` receives and encodes on ring rank i."""
    first, plan = ring_schedule(n, i, bounds, step, own, mode)
    received = sum(chunk_bytes(r.b - r.a) for r in plan)
    encoded = sum(chunk_bytes(b - a) for a, b in first) + sum(
        chunk_bytes(r.b - r.a) for r in plan if r.reduce and not (r.finish and mode == "reduce_scatter"))
    return received, encoded


# --- latency algorithms ----------------------------------------------------------------------

def recursive_doubling(link: Link, work: np.ndarray, op: str, step: int, tmp: np.ndarray) -> None:
    """All-reduce in ceil(log2 n) exchanges of the whole buffer (with one extra exchange
    in and out for the ranks past the largest power of two); every rank ends with the
    same partial in `work`. Each pair combines (lower group rank's part) op (higher's)."""
    n, i = link.n, link.me
    p2 = 1 << (n.bit_length() - 1)
    if i >= p2:  # fold into rank i - p2, then receive the result from it
        link.wait(send_all(link, i - p2, work, step))
        link.wait(recv_all(link, i - p2, work, step))
        return
    if i + p2 < n:
        link.wait(recv_all(link, i + p2, tmp, step))
        reduction.combine(op, work, tmp, out=work)
    mask = 1
    while mask < p2:
        partner = i ^ mask
        link.wait(send_all(link, partner, work, step) + recv_all(link, partner, tmp, step))
        if partner < i:
            reduction.combine(op, tmp, work, out=work)
        else:
            reduction.combine(op, work, tmp, out=work)
        mask <<= 1
    if i + p2 < n:
        link.wait(send_all(link, i + p2, work, step))


def tree_reduce(link: Link, work: np.ndarray, op: str, root: int, step: int, tmp: np.ndarray) -> bool:
    """Binomial-tree reduce toward group rank `root`; True on the root, whose `work` then
    holds the partial over all ranks (children combine after their parent's own part)."""
    n = link.n
    v = (link.me - root) % n  # rank relative to the root
    mask = 1
    while mask < n:
        if v & mask:
            link.wait(send_all(link, (v - mask + root) % n, work, step))
            return False
        if v + mask < n:
            link.wait(recv_all(link, (v + mask + root) % n, tmp, step))
            reduction.combine(op, work, tmp, out=work)
        mask <<= 1
    return True


def tree_broadcast(link: Link, buf: np.ndarray, root: int, step: int) -> None:
    """Binomial-tree broadcast from group rank `root` of `buf` (filled on every other rank)."""
    n = link.n
    v = (link.me - root) % n
    mask = 1
    while mask < n:  # receive from the parent: the rank that differs in v's lowest set bit
        if v & mask:
            link.wait(recv_all(link, (v - mask + root) % n, buf, step))
            break
        mask <<= 1
    mask >>= 1
    handles = []
    while mask > 0:
        if v + mask < n:
            handles += send_all(link, (v + mask + root) % n, buf, step)
        mask >>= 1
    link.wait(handles)


def chain_broadcast(link: Link, buf: np.ndarray, root: int, step: int) -> None:
    """Pipelined broadcast along the chain root, root+1, ...: each chunk is forwarded as
    soon as it arrives, so large buffers take about one transfer time, not log n."""
    n = link.n
    v = (link.me - root) % n
    nxt = (link.me + 1) % n if v < n - 1 else None
    handles: list[Handle] = []
    if v == 0:
        handles += send_all(link, nxt, buf, step)
    else:
        for a, b in chunks(0, len(buf), step):
            forward = (lambda a=a, b=b: handles.append(link.send(nxt, buf[a:b]))) if nxt is not None else None
            handles.append(link.recv((link.me - 1) % n, buf[a:b], on_done=forward))
    link.wait(handles)


def direct_all_gather(link: Link, out: np.ndarray, count: int, step: int) -> None:
    """Every rank sends its block (already at block `me` of `out`) to every other rank."""
    i = link.me
    mine = out[i * count:(i + 1) * count]
    handles = []
    for d in range(1, link.n):  # staggered, so ranks do not all send to rank 0 first
        to, frm = (i + d) % link.n, (i - d) % link.n
        handles += send_all(link, to, mine, step)
        handles += recv_all(link, frm, out[frm * count:(frm + 1) * count], step)
    link.wait(handles)


def direct_all_to_all(link: Link, src: np.ndarray, dst: np.ndarray, count: int, step: int) -> None:
    """Block j of `src` goes to rank j; block j of `dst` comes from rank j."""
    i = link.me
    dst[i * count:(i + 1) * count] = src[i * count:(i + 1) * count]
    handles = []
    for d in range(1, link.n):
        to, frm = (i + d) % link.n, (i - d) % link.n
        handles += send_all(link, to, src[to * count:(to + 1) * count], step)
        handles += recv_all(link, frm, dst[frm * count:(frm + 1) * count], step)
    link.wait(handles)


def dissemination_barrier(link: Link) -> None:
    """ceil(log2 n) rounds of empty messages: round k, send to me + 2^k, receive from me - 2^k."""
    n, i = link.n, link.me
    empty = np.empty(0, np.uint8)
    k = 1
    while k < n:
        link.wait([link.send((i + k) % n, empty), link.recv((i - k) % n, empty)])
        k <<= 1
