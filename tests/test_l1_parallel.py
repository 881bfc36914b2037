"""Runtime L1, beyond DP x TP: over 4 processes started by `dtm launch` (real processes on
127.0.0.1), (a) dtm.shard_map's explicit collectives (all_reduce, all_gather, reduce_scatter,
all_to_all, broadcast over mesh axes) give what numpy computes here from the spec's group
definitions (2.6, 3.11); (b) distribute / redistribute / full_tensor round-trip a tensor with
an uneven dim; (c) one AdamW step of a small GPT-2 under FSDP=4 (all_gather before use,
reduce_scatter of the gradients) gives the loss and weights of the same step on one device,
computed in the test process; (d) a hand-written local-view program with barrier, send, recv
and an all_gather of q8_0 blocks runs over the processes as the reference runs it on threads;
(e) a jitted program's all_reduce between processes gives each run's own sum when the plan
writes it into the array it keeps from run to run, and a returned all_reduce result stays
the caller's when the program runs again. One launch does all five, to start processes once.
Run as a script, this file is one rank's side: (a), (b), (d) and (e) assert on every rank,
rank 0 writes (c)."""

from __future__ import annotations

import pathlib
import sys

import numpy as np

# The same small GPT-2 and AdamW step, and the launch (this folder is on sys.path).
from test_l1_gpt2 import _model_and_step, assert_equals_one_device_step, launch_four

HERE = pathlib.Path(__file__).resolve()
PG_TIMEOUT_S = 60  # every collective wait of a rank

X = np.arange(4 * 8, dtype=np.float32).reshape(4, 8) / 4


def piece(d: int, t: int) -> np.ndarray:
    """Rank (dp=d, tp=t)'s piece of X under {"dp": Shard(0), "tp": Shard(1)}."""
    return X[2 * d:2 * d + 2, 4 * t:4 * t + 4]


def check_shard_map(rank: int) -> None:
    """Each collective on the dp=2 x tp=2 process mesh: this rank's piece and the whole value."""
    import dtm
    from dtm import Replicate, Shard

    mesh = dtm.Mesh({"dp": 2, "tp": 2})
    assert mesh.process is not None and mesh.rank == rank
    spec = {"dp": Shard(0), "tp": Shard(1)}
    d, t = divmod(rank, 2)

    def run(fn, out_spec):
        y = dtm.shard_map(fn, mesh, in_specs=(spec,), out_specs=out_spec)(dtm.tensor(X))
        shards = y.local_shards()
        assert all(p is None for r, p in enumerate(shards) if r != rank)  # other processes' pieces
        return shards[rank].numpy(), y.numpy()  # y.numpy(): gathered from every process

    mine, whole = run(lambda a: dtm.all_reduce(a, axis="tp"), {"dp": Shard(0)})
    np.testing.assert_array_equal(mine, piece(d, 0) + piece(d, 1))
    np.testing.assert_array_equal(whole, np.concatenate([piece(e, 0) + piece(e, 1) for e in range(2)]))

    mine, whole = run(lambda a: dtm.all_reduce(a, op="max", axis=("dp", "tp")), Replicate())
    np.testing.assert_array_equal(whole, np.maximum.reduce([piece(e, u) for e in range(2) for u in range(2)]))

    mine, whole = run(lambda a: dtm.all_gather(a, dim=0, axis="dp"), {"tp": Shard(1)})
    np.testing.assert_array_equal(mine, X[:, 4 * t:4 * t + 4])
    np.testing.assert_array_equal(whole, X)

    mine, whole = run(lambda a: dtm.reduce_scatter(a, dim=1, axis="tp"), spec)
    summed = [piece(e, 0) + piece(e, 1) for e in range(2)]  # the tp reduction on row block e
    np.testing.assert_array_equal(mine, summed[d][:, 2 * t:2 * t + 2])
    np.testing.assert_array_equal(whole, np.concatenate(summed))  # blocks (d, t) laid back by the spec

    # block t of every tp peer's piece (split along dim 1), joined along dim 0 in peer order
    mine, whole = run(lambda a: dtm.all_to_all(a, split_dim=1, concat_dim=0, axis="tp"), spec)
    np.testing.assert_array_equal(mine, np.concatenate([piece(d, u)[:, 2 * t:2 * t + 2] for u in range(2)]))
    assert whole.shape == (8, 4)

    mine, whole = run(lambda a: dtm.broadcast(a, src=1, axis="dp"), {"tp": Shard(1)})
    np.testing.assert_array_equal(mine, piece(1, t))
    np.testing.assert_array_equal(whole, X[2:4])


def check_round_trip(rank: int) -> None:
    """A 7 x 6 tensor (7 rows over dp=2: 4 and 3) distributed, computed on, redistributed and
    gathered back."""
    import dtm
    from dtm import Replicate, Shard

    a = np.random.default_rng(1).standard_normal((7, 6)).astype(np.float32)
    mesh = dtm.Mesh({"dp": 2, "tp": 2})
    d, t = divmod(rank, 2)
    x = dtm.distribute(dtm.tensor(a), mesh, {"dp": Shard(0), "tp": Shard(1)})
    rows = [slice(0, 4), slice(4, 7)]  # spec 2.7: chunks of ceil(7 / 2) rows, the last one shorter
    np.testing.assert_array_equal(x.local_shards()[rank].numpy(), a[rows[d], 3 * t:3 * t + 3])
    y = (x * 2 + 1).redistribute({"dp": Replicate(), "tp": Shard(0)})
    assert y.placements == (Replicate(), Shard(0))
    np.testing.assert_allclose(y.local_shards()[rank].numpy(), (a * 2 + 1)[rows[t]], rtol=1e-6)
    np.testing.assert_allclose(y.full_tensor().numpy(), a * 2 + 1, rtol=1e-6)
    np.testing.assert_allclose(x.sum(0).full_tensor().numpy(), a.sum(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(x.full_tensor().numpy(), a)


def local_program(rank: int) -> str:
    """Rank `rank`'s local view on the dp=2 x tp=2 mesh: a barrier, its x sent to its tp peer
    and the peer's received, and the q8_0 blocks of x gathered over dp."""
    peer = 1 - rank % 2
    return f"""dtm 1.0

mesh @m[dp = 2, tp = 2]

func @f(%x: f32[2, 32]) -> (f32[2, 32], q8_0[4, 32]) {{
  barrier {{mesh = @m, axes = ["dp", "tp"]}}
  send %x {{mesh = @m, axes = ["tp"], dst = {peer}}}
  %r = recv {{mesh = @m, axes = ["tp"], src = {peer}}} : f32[2, 32]
  %q = cast %x {{to = q8_0}} : q8_0[2, 32]
  %g = all_gather %q {{mesh = @m, axes = ["dp"], dim = 0}} : q8_0[4, 32]
  return %r, %g
}}
"""


def check_local_program(rank: int) -> None:
    """(d): over processes (L1's `ProcessComm`), each rank gets its tp peer's x and the q8_0
    blocks of both dp ranks' x as the reference quantizes them, in group order."""
    import dtm.ir as ir
    from dtm.ir import DTYPES
    from dtm.ref import quantize
    from dtm.runtime import l1

    xs = [np.random.default_rng(r).standard_normal((2, 32)).astype(np.float32) for r in range(4)]
    got = l1.executor().run(ir.verify(ir.parse(local_program(rank))), "f", [xs[rank]])
    np.testing.assert_array_equal(got[0], xs[rank ^ 1])
    t = rank % 2  # the dp group of (dp, tp) = (d, t) is ranks t and 2 + t
    np.testing.assert_array_equal(got[1], np.concatenate([quantize(xs[t], DTYPES["q8_0"]),
                                                          quantize(xs[2 + t], DTYPES["q8_0"])]))


def check_jitted_all_reduce() -> None:
    """(e): column sums of X's rows spread over dp=4, under dtm.jit, on three inputs."""
    import dtm

    mesh = dtm.Mesh({"dp": 4})

    @dtm.jit
    def total(x):  # the all_reduce's own result is returned: a fresh array each run
        return x.sum(0).redistribute([dtm.Replicate()])

    @dtm.jit
    def scaled(x):  # the all_reduce's result stays in the plan: the array it keeps (Plan.reused_results)
        return x.sum(0).redistribute([dtm.Replicate()]) * 2.0

    first = total(dtm.distribute(dtm.tensor(X), mesh, [dtm.Shard(0)]))
    for k in (1.0, 10.0, -3.0):
        x = dtm.distribute(dtm.tensor(X * k), mesh, [dtm.Shard(0)])
        np.testing.assert_array_equal(scaled(x).full_tensor().numpy(), 2 * (X * k).sum(0))
        np.testing.assert_array_equal(total(x).full_tensor().numpy(), (X * k).sum(0))
    np.testing.assert_array_equal(first.full_tensor().numpy(), X.sum(0))  # not overwritten by the later runs


def rank_main(out: str) -> None:
    import dtm
    from dtm.parallel import fsdp

    pg = dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S)
    check_shard_map(pg.rank)
    check_round_trip(pg.rank)
    check_local_program(pg.rank)
    check_jitted_all_reduce()
    model, step = _model_and_step()
    m = model()
    params = list(m.parameters())
    mesh = dtm.Mesh({"dp": 4})
    loss = step(fsdp(m, mesh), params)
    assert m.wte.weight.placements == (dtm.Shard(0),)
    assert m.wte.weight.local_shards()[pg.rank].shape == ((26, 32) if pg.rank < 3 else (23, 32))
    full = {name: p.numpy() for name, p in m.state_dict().items()}  # gathered from every rank
    if pg.rank == 0:
        np.savez(out, loss=np.float64(loss), **full)


def test_shard_map_round_trip_and_fsdp_over_four_processes(tmp_path):
    assert_equals_one_device_step(launch_four(HERE, tmp_path / "rank0.npz"))


if __name__ == "__main__":
    rank_main(sys.argv[1])
