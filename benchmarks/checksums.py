"""The cost of end-to-end tensor checksums (spec 9.4.9, issue 31): P2P (a send/recv
ping-pong between ranks 0 and 1) and broadcast (from rank 0) between 2 processes on this
host, over TCP and over shared memory, with DTM_CHECKSUMS on and off in the same run.

Each (transport, on/off) pair is its own set of processes, launched once; they take turns
size by size, so both see the same machine load. A time is the median over iterations of
the slowest rank's; `on / off` is the ratio of the times (1.00: free). With checksums on
the sender computes one CRC32C of the tensor and the receiver one more (a broadcast's root
checks its own copy too); the frames' own CRCs are there either way.

    python benchmarks/checksums.py                          # 1M .. 64M, tcp and shm
    python benchmarks/checksums.py --sizes 1M 64M --iters 5 --transports shm
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from collectives import Group, iterations, parse_size, ping_pong, serve, show_size

ENV = "DTM_CHECKSUMS"  # (dtm.protocol.checksums.ENV; read here before dtm is imported by the ranks)
OPS = ("sendrecv", "broadcast")
DEFAULT_SIZES = ["1M", "4M", "16M", "64M"]


def worker(kind, rank, n, q_port, q_addrs, q_cmd, q_out, opts):
    """One rank: `kind` is "tcp-on", "shm-off", ...; the switch is set before the Hello."""
    transport_kind, switch = kind.split("-")
    os.environ[ENV] = "1" if switch == "on" else "0"
    from dtm.comm import Communicator
    from dtm.comm.shm import connect_local
    from dtm.comm.tcp import connect_mesh, listen
    listener = listen()
    q_port.put((rank, listener.getsockname()[1]))
    addresses = q_addrs.get(timeout=120)
    connect = connect_local if transport_kind == "shm" else connect_mesh
    transport = connect(rank, n, addresses, b"bench", listener=listener, timeout=600)
    comm = Communicator(transport)
    if opts["op"] == "sendrecv":
        op = ping_pong(rank, comm.send, lambda x, peer: comm.recv(peer, out=x))
    else:
        op = lambda x: comm.broadcast(x, 0)  # noqa: E731
    serve(rank, q_cmd, q_out, op, comm.barrier, np.zeros)
    comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="bytes, with K/M/G suffixes")
    ap.add_argument("--iters", type=int, default=30, help="iterations at 1 MiB (fewer for larger sizes)")
    ap.add_argument("--transports", nargs="+", default=["tcp", "shm"], choices=["tcp", "shm"])
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes]
    print(f"host: {os.cpu_count()} cores; 2 ranks; time: median of the slowest rank (a round trip for P2P)")
    for op in args.ops:
        kinds = [f"{t}-{s}" for t in args.transports for s in ("on", "off")]
        groups = {k: Group(k, 2, {"op": op}, worker=worker) for k in kinds}
        try:
            print(f"\n{op} f32" + (" ping-pong" if op == "sendrecv" else " from rank 0"))
            print(f"{'size':>6}" + "".join(f" | {t + ' on':>11} {t + ' off':>11} {'on/off':>6}"
                                           for t in args.transports))
            for s in sizes:
                times = {k: g.measure(s, iterations(s, args.iters)) for k, g in groups.items()}
                print(f"{show_size(s):>6}" + "".join(
                    f" | {times[t + '-on'] * 1e3:>9.2f}ms {times[t + '-off'] * 1e3:>9.2f}ms "
                    f"{times[t + '-on'] / times[t + '-off']:>6.2f}" for t in args.transports), flush=True)
        finally:
            for g in groups.values():
                g.stop()


if __name__ == "__main__":
    main()
