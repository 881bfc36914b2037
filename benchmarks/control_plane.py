"""The control plane at scale (issue 33): one coordinator and N ranks' control connections,
each a real protocol client (dtm.cluster.membership: the handshake, JoinMesh, Heartbeats
every heartbeat_ms, real frames on real loopback sockets), the ranks spread over a few
processes of threads. No data moves: what is measured is membership.

For each rank count it reports:
- join: from the moment every client process starts joining until the last rank holds the
  MeshView of epoch 1;
- CPU: the coordinator process's CPU over `--steady` seconds of heartbeats, as a share of
  one core, and its resident memory;
- death: one rank hangs (its heartbeat thread stops, its connection stays open): the time
  from its last heartbeat until every survivor was told (E1001), against the bound
  timeout_ms + heartbeat_ms (spec 9.6.4);
- resize: with an elastic coordinator (spec 9.6.7), from that notice until every survivor
  holds the MeshView of epoch 2 (each survivor rejoins as soon as it hears of the loss).

    python benchmarks/control_plane.py                       # 1,000 and 4,000 ranks
    python benchmarks/control_plane.py --ranks 250 1000 4000 --record docs/benchmarks   # with its plot (record.py)

Goals: 1,000 ranks join in under 10 s; a death known to all within 2 s of the heartbeat
bound; coordinator CPU under 10% of one core at steady state.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import resource
import secrets
import time

from record import lines, record

TOKEN_BYTES = 16


def _quietly_with_more_files() -> None:
    """Each rank holds a few descriptors (its connection, its listener, a wake pair); and
    each loss or resize is logged once per rank: thousands of lines."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    logging.getLogger("dtm").setLevel(logging.ERROR if os.environ.get("CP_QUIET", "1") == "1" else logging.WARNING)


def coordinator_main(conn, n: int, token: bytes, heartbeat_ms: int, timeout_ms: int) -> None:
    """The coordinator in a process of its own, so that its CPU and memory are its own."""
    _quietly_with_more_files()
    from dtm.cluster.heartbeat import rss_bytes
    from dtm.cluster.resize import ElasticCoordinator

    coord = ElasticCoordinator(n, token, heartbeat_ms=heartbeat_ms, timeout_ms=timeout_ms, join_timeout=600,
                               elastic=(1, n)).start()
    conn.send(coord.address)
    while True:
        cmd = conn.recv()
        if cmd == "formed":  # when it published the view of epoch 1 (wall clock)
            coord.formed.wait()
            conn.send(coord.formed_at)
        elif cmd == "usage":
            ru = resource.getrusage(resource.RUSAGE_SELF)
            conn.send((ru.ru_utime + ru.ru_stime, rss_bytes(), time.monotonic()))
        else:
            coord.stop()
            conn.send("stopped")
            return


class SimRank:
    """One rank's control connection, driven by its process's event loop: the handshake
    (`Control`, as a rank's Membership does it), JoinMesh, a Heartbeat every heartbeat_ms
    from when it holds the view, and, told of a lost peer, a rejoin of the resizing mesh
    (spec 9.6.7) with a new data address. The data addresses are only names: no data moves."""

    def __init__(self, rank: int, n: int, token: bytes):
        from dtm.cluster.conn import Control
        from dtm.cluster.membership import VIEW_MAX_PAYLOAD

        self.rank, self.n = rank, n
        self.control = Control("connect", token, rank=rank, name=f"sim:{rank}", max_payload=VIEW_MAX_PAYLOAD,
                               peer="the coordinator")
        self.joined_at = self.told_at = self.viewed_at = None
        self.beating = True
        self.epoch = 0

    async def run(self, address: tuple[str, int], stats, heartbeat_s: float) -> None:
        from dtm.cluster.heartbeat import Figures, heartbeat
        from dtm.protocol.messages import Error, JoinMesh, MeshView

        reader, writer = await asyncio.open_connection(*address)
        writer.write(self.control.start())
        pending = []
        while not self.control.ready:
            reply, messages = self.control.feed(await reader.read(1 << 16))
            writer.write(reply)
            pending += messages
        node = f"sim-node-{self.rank // 8}"  # eight ranks to a "host", as a GPU node has
        writer.write(self.control.encode(JoinMesh(self.rank, self.n, "127.0.0.1", 10000 + self.rank, node, 1)))

        async def beat() -> None:
            while self.beating:
                writer.write(self.control.encode(heartbeat(self.rank, stats, Figures())))
                await asyncio.sleep(heartbeat_s)
        while True:
            data = await reader.read(1 << 16)
            if not data:
                return
            for msg in pending + [_decode(h, payload) for h, payload in self.control.decoder.feed(data)]:
                if isinstance(msg, MeshView) and msg.epoch > self.epoch:
                    self.epoch = self.control.epoch = self.control.decoder.expected_epoch = msg.epoch
                    if self.joined_at is None:
                        self.joined_at = time.time()
                        asyncio.get_running_loop().create_task(beat())
                    else:
                        self.viewed_at = time.time()
                elif isinstance(msg, Error) and msg.code == "E1001" and self.told_at is None:
                    self.told_at = time.time()  # and rejoin the resizing mesh at once, at a new address
                    writer.write(self.control.encode(JoinMesh(self.rank, 0, "127.0.0.1", 30000 + self.rank, node, 1)))
            pending = []


_views: dict[bytes, object] = {}


def _decode(header, payload: bytes):
    """A checked frame's message; a MeshView's payload is decoded once per process. Every
    rank of the process gets the same view, and decoding thousands of views of thousands
    of members would be the simulation's own cost (on a real cluster each rank decodes one
    view, on its own core: 12 ms for 4,000 members)."""
    from dtm.protocol.frame import MsgType
    from dtm.protocol.messages import decode_message

    if header.msg_type is not MsgType.MESH_VIEW:
        return decode_message(header, payload)
    if payload not in _views:
        _views[payload] = decode_message(header, payload)
    return _views[payload]


def ranks_main(conn, ranks: list[int], n: int, address: tuple[str, int], token: bytes, go: float,
               heartbeat_ms: int) -> None:
    """Ranks `ranks` of n, on one event loop."""
    _quietly_with_more_files()
    from dtm.cluster.heartbeat import ProcessStats

    sims = {r: SimRank(r, n, token) for r in ranks}
    stats = ProcessStats()
    loop = asyncio.new_event_loop()
    tasks = []

    async def start() -> None:
        await asyncio.sleep(max(0.0, go - time.time()))
        for sim in sims.values():
            tasks.append(loop.create_task(sim.run(address, stats, heartbeat_ms / 1000)))

    def serve() -> None:  # the driver's commands, answered from the loop's thread
        loop.run_until_complete(start())
        while True:
            while not conn.poll(0):
                loop.run_until_complete(asyncio.sleep(0.02))
                failed = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()]
                if failed:
                    conn.send(("failed", repr(failed[0])))
                    return
            cmd = conn.recv()
            if cmd[0] == "joined":
                times = [s.joined_at for s in sims.values()]
                conn.send(max(times) if all(times) else None)
            elif cmd[0] == "hang":  # its heartbeats stop; its connection stays open
                sims[cmd[1]].beating = False
                conn.send(time.time())
            elif cmd[0] == "told":
                survivors = [s for r, s in sims.items() if r != cmd[1]]
                conn.send(([s.told_at for s in survivors], [s.viewed_at for s in survivors]))
            else:
                for t in asyncio.all_tasks(loop):
                    t.cancel()
                loop.run_until_complete(asyncio.gather(*asyncio.all_tasks(loop), return_exceptions=True))
                loop.close()
                conn.send("stopped")
                return
    serve()


def measure(n: int, procs: int, heartbeat_ms: int, timeout_ms: int, steady: float) -> dict:
    ctx = mp.get_context("spawn")
    token = secrets.token_hex(TOKEN_BYTES).encode()
    c_here, c_there = ctx.Pipe()
    coord = ctx.Process(target=coordinator_main, args=(c_there, n, token, heartbeat_ms, timeout_ms), daemon=True)
    coord.start()
    address = c_here.recv()
    go = time.time() + 3.0  # every client process started and imported before the clock runs
    pipes, workers = [], []
    for p in range(procs):
        here, there = ctx.Pipe()
        w = ctx.Process(target=ranks_main, args=(there, list(range(p, n, procs)), n, address, token, go,
                                                 heartbeat_ms), daemon=True)
        w.start()
        pipes.append(here)
        workers.append(w)
    while True:  # until every rank holds the view of epoch 1
        done = []
        for pipe in pipes:
            pipe.send(("joined",))
            reply = pipe.recv()
            if isinstance(reply, tuple):
                raise SystemExit(f"a client process failed: {reply[1]}")
            done.append(reply)
        if all(done):
            break
        time.sleep(0.1)
    c_here.send("formed")
    formed = c_here.recv()
    out = {"ranks": n, "formed_s": formed - go, "join_s": max(done) - go}
    time.sleep(2.0)  # past the formation's burst
    c_here.send("usage")
    cpu0, _, t0 = c_here.recv()
    time.sleep(steady)
    c_here.send("usage")
    cpu1, rss, t1 = c_here.recv()
    out["cpu_percent"], out["rss_mib"] = 100 * (cpu1 - cpu0) / (t1 - t0), rss / 2**20
    victim = n - 1
    pipes[victim % procs].send(("hang", victim))
    hung = pipes[victim % procs].recv()
    deadline = time.time() + (timeout_ms + heartbeat_ms) / 1000 + 60
    while True:  # until every survivor was told and holds the new view
        told, viewed = [], []
        for pipe in pipes:
            pipe.send(("told", victim))
            t, v = pipe.recv()
            told += t
            viewed += v
        if all(told) and all(viewed) or time.time() > deadline:
            break
        time.sleep(0.2)
    if not all(told):
        raise SystemExit(f"{told.count(None)} survivor(s) were never told of the hung rank")
    # its last heartbeat was at most one interval before it hung
    out["death_s"] = max(told) - hung
    out["bound_s"] = (timeout_ms + heartbeat_ms) / 1000
    out["resize_s"] = max(viewed) - max(told) if all(viewed) else float("nan")
    for pipe in pipes:
        pipe.send(("stop",))
        pipe.recv()
    c_here.send("stop")
    c_here.recv()
    for w in [*workers, coord]:
        w.join(timeout=30)
        if w.is_alive():
            w.kill()
    return out


def draw(figures: dict, fig) -> None:
    """Each figure against the rank count, a panel each, with its goal or bound."""
    rows = figures["rows"]
    bound = rows[0]["bound_s"]
    panels = [("join_s", "all joined (s)", 10.0, "goal at 1,000 ranks"),
              ("death_s", "death known to all (s)", bound + 2, "goal: the bound + 2 s"),
              ("cpu_percent", "coordinator CPU (% of a core)", 10.0, "goal at 1,000 ranks"),
              ("rss_mib", "coordinator RSS (MiB)", None, "")]
    ranks = [r["ranks"] for r in rows]
    for ax, (key, title, goal, goal_label) in zip(fig.subplots(2, 2).flat, panels):
        lines(ax, {"DTM coordinator": [[r["ranks"], r[key]] for r in rows]}, title=title, xlabel="ranks", ylabel="",
              goal=goal, goal_label=goal_label, logx=True, xticks=[(n, str(n)) for n in ranks])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--procs", type=int, default=4, help="client processes the ranks are spread over")
    ap.add_argument("--heartbeat-ms", type=int, default=500)
    ap.add_argument("--timeout-ms", type=int, default=5000)
    ap.add_argument("--steady", type=float, default=5.0, help="seconds of heartbeats the CPU figure covers")
    ap.add_argument("--record", metavar="DIR", help="keep the figures and their plot (each against the rank count) in DIR")
    args = ap.parse_args()
    print(f"host: {os.cpu_count()} cores; heartbeat every {args.heartbeat_ms} ms, lost after {args.timeout_ms} ms "
          f"(bound {(args.timeout_ms + args.heartbeat_ms) / 1000:g} s); ranks in {args.procs} processes")
    print(f"{'ranks':>6} | {'formed':>7} | {'all hold it':>11} | {'coord CPU':>9} | {'coord RSS':>9} | "
          f"{'death known to all':>18} | {'new view':>8}")
    rows = []
    for n in args.ranks:
        r = measure(n, args.procs, args.heartbeat_ms, args.timeout_ms, args.steady)
        rows.append(r)
        print(f"{n:>6} | {r['formed_s']:>6.2f}s | {r['join_s']:>10.2f}s | {r['cpu_percent']:>8.1f}% | {r['rss_mib']:>5.0f} MiB | "
              f"{r['death_s']:>6.2f}s (bound {r['bound_s']:g}s) | {r['resize_s']:>7.2f}s", flush=True)
    if args.record:
        record(args.record, "control_plane", {"heartbeat_ms": args.heartbeat_ms, "timeout_ms": args.timeout_ms,
                                              "procs": args.procs, "rows": rows}, draw)


if __name__ == "__main__":
    main()
