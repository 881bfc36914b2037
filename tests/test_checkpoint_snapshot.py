"""In-memory snapshots (spec 9.4.12): `dtm.checkpoint.snapshot(state)` and
`dtm.checkpoint.load(state, "mem://")`. In one process the copy is this process's own;
under `dtm launch` two ranks reload with other placements (values against numpy) and a
snapshot that did not complete on every rank is never used; three ranks lose one to
SIGKILL, and the survivors read its pieces from their replicas. Every wait is bounded."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
TIMEOUT_S = 240    # a whole launch, the ranks sharing 2 busy cores
PG_TIMEOUT_S = 60  # joining the mesh and every collective

W = np.arange(9 * 6, dtype=np.float32).reshape(9, 6) / 8  # 9 rows: 5 and 4 over 2 ranks, 3 each over 3
B = np.linspace(-1, 1, 7).astype(np.float32)
_X = np.random.default_rng(0).standard_normal((4, 16, 6)).astype(np.float32)
_Y = np.random.default_rng(1).standard_normal((4, 16, 3)).astype(np.float32)


def _model(seed: int):
    import dtm
    from dtm import nn

    dtm.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


def _train(model, opt, i: int) -> None:
    import dtm
    from dtm import nn

    nn.functional.mse_loss(model(dtm.tensor(_X[i])), dtm.tensor(_Y[i])).backward()
    opt.step()
    opt.zero_grad()


def _values(model, opt) -> dict[str, np.ndarray]:
    """Copies of every tensor of the model's and the optimizer's state, by name."""
    out = {f"model/{k}": v.numpy().copy() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": np.array(v.numpy() if hasattr(v, "numpy") else v, copy=True)
                    for k, v in s.items()})
    return out


def _equal(model, opt, want: dict[str, np.ndarray]) -> list[str]:
    """The names whose values differ from `want` (empty: all equal)."""
    have = _values(model, opt)
    return sorted(k for k in want if k not in have or not np.array_equal(have[k], want[k]))


# --- one process ----------------------------------------------------------------------------------

@pytest.fixture
def fresh(monkeypatch):
    """No snapshot held by this test process from an earlier test."""
    snapshots = importlib.import_module("dtm.ckpt.snapshot")  # (dtm.ckpt.snapshot is the function)

    monkeypatch.setattr(snapshots, "_sessions", {})
    return snapshots


def test_one_process_keeps_its_own_copy_and_loads_it_back(fresh):
    import dtm

    m = _model(0)
    opt = dtm.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    _train(m, opt, 0)
    h = dtm.checkpoint.snapshot({"model": m, "optim": opt, "step": 1})
    assert h.step == 0 and h.done()  # complete at once: a copy in this process's memory
    want = _values(m, opt)
    _train(m, opt, 1)  # the live state moves on
    assert _equal(m, opt, want)

    m2, opt2 = _model(5), None
    opt2 = dtm.optim.AdamW(m2.parameters(), lr=1.0)
    state = {"model": m2, "optim": opt2, "step": None}
    dtm.checkpoint.load(state, "mem://")
    assert state["step"] == 1 and _equal(m2, opt2, want) == []
    # the same training from there gives the same values as the run that went on
    _train(m2, opt2, 1)
    assert _equal(m2, opt2, _values(m, opt)) == []


def test_one_process_keeps_the_two_newest_and_reshards_an_l0_mesh(fresh):
    import dtm

    dtm.devices(4)
    mesh = dtm.Mesh({"dp": 2, "tp": 2})
    for step in (3, 4, 7, 9):  # (7 and 9 pack into the arrays, through the views, of 3 and 4)
        state = {"w": dtm.distribute(dtm.tensor(W * step), mesh, [dtm.Shard(0), dtm.Shard(1)]),
                 "b": dtm.distribute(dtm.tensor(B), dtm.Mesh({"x": 2}), [dtm.Replicate()]), "n": step}
        assert dtm.checkpoint.snapshot(state, step=step).wait().step == step
    assert fresh.snapshots() == [7, 9]
    (w,) = [t for t in fresh.find().doc["tensors"] if t["name"] == "w"]
    assert len(w["pieces"]) == 4  # each distinct piece once

    other = {"w": dtm.distribute(dtm.zeros(9, 6), dtm.Mesh({"x": 3}), [dtm.Shard(1)]), "b": dtm.zeros(7), "n": 0}
    dtm.checkpoint.load(other, "mem://")
    assert other["w"].placements == (dtm.Shard(1),) and other["n"] == 9
    np.testing.assert_array_equal(other["w"].numpy(), W * 9)
    np.testing.assert_array_equal(other["b"].numpy(), B)
    dtm.checkpoint.load(other, "mem://", step=7)
    np.testing.assert_array_equal(other["w"].numpy(), W * 7)


def test_one_process_errors(fresh):
    import dtm
    from dtm.errors import ErrorCode

    with pytest.raises(dtm.checkpoint.NoSnapshot) as e:
        dtm.checkpoint.load({"w": dtm.zeros(2)}, "mem://")
    assert e.value.code is ErrorCode.NO_SNAPSHOT and "dtm.checkpoint.snapshot" in str(e.value)
    dtm.checkpoint.snapshot({"w": dtm.tensor(B)}, step=5)
    with pytest.raises(dtm.DTMError) as e:
        dtm.checkpoint.snapshot({"w": dtm.tensor(B)}, step=5)
    assert e.value.code is ErrorCode.ATTRIBUTE_VALUE and "greater than the newest complete snapshot's (5)" \
        in str(e.value)
    with pytest.raises(dtm.DTMError) as e:
        dtm.checkpoint.snapshot({"w": object()})
    assert e.value.code is ErrorCode.ATTRIBUTE_TYPE and "w: a object is not saved" in str(e.value)
    with pytest.raises(dtm.DTMError) as e:
        dtm.checkpoint.snapshot({"w": dtm.tensor(B)}, replicas=0)
    assert e.value.code is ErrorCode.ATTRIBUTE_VALUE
    with pytest.raises(dtm.checkpoint.NoSnapshot) as e:
        dtm.checkpoint.load({"w": dtm.zeros(7)}, "mem://", step=4)
    assert "it holds steps [5]" in str(e.value)
    with pytest.raises(dtm.checkpoint.CheckpointTypeError):  # as a checkpoint on disk
        dtm.checkpoint.load({"w": dtm.zeros(8)}, "mem://")


# --- processes ------------------------------------------------------------------------------------

def test_a_resize_puts_each_blob_some_rank_lacks_once():
    """Spec 9.6.7, "Moving the state", step 4: after a DP=2 x TP=2 mesh lost rank 3, new
    rank 0 carried every writer's blob and rank 1 those of writers 1 and 3: the blobs both
    hold are put nowhere, the others by rank 0. When two ranks join, every blob is lacked by
    someone, each is put once, by the holder with the fewest bytes to put so far, largest
    blob first."""
    from dtm.ckpt.snapshot import _putters

    piece = [{"owner": o, "offset": at, "nbytes": n}
             for o, at, n in ((0, 0, 100), (1, 0, 300), (2, 0, 200), (3, 64, 236))]
    doc = {"tensors": [{"pieces": piece[:2]}, {"pieces": piece[2:]}]}
    holders = {0: [0], 1: [0, 1], 2: [0], 3: [0, 1]}
    assert _putters(doc, holders, 2) == {0: 0, 2: 0}
    assert _putters(doc, holders, 4) == {1: 0, 3: 1, 2: 0, 0: 0}


def _launch(n: int, args: list[str], *extra: str) -> tuple[subprocess.CompletedProcess, dict[int, dict]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTM_")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", DTM_HOST="127.0.0.1")
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", str(n), "--join-timeout", str(PG_TIMEOUT_S), *extra,
           str(HERE), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = {}
    for line in proc.stdout.splitlines():
        if "RESULT " in line:  # (the launcher prefixes each line with its rank)
            d = json.loads(line.split("RESULT ", 1)[1])
            out[d["rank"]] = d
    return proc, out


def _report(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def two_ranks_main() -> None:
    """Snapshot 1 (w sharded by rows, b replicated, a DDP model and its AdamW state
    replicated over the processes); reload it with other placements. Snapshot 2 of other values fails on
    rank 1 after rank 0's pieces went out: it is not used, snapshot 1 is; taken again, it is."""
    import dtm
    snapshots = importlib.import_module("dtm.ckpt.snapshot")  # (dtm.ckpt.snapshot is the function)
    from dtm.errors import DTMError, ErrorCode

    pg = dtm.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    r = pg.rank
    mesh = dtm.Mesh({"dp": 2})
    m = dtm.parallel.DDP(_model(0), mesh, axis="dp")
    opt = dtm.optim.AdamW(m.parameters(), lr=1e-2)
    _train(m, opt, 0)
    state = {"w": dtm.distribute(W, mesh, [dtm.Shard(0)]), "b": dtm.distribute(B, mesh, [dtm.Replicate()]),
             "model": m, "optim": opt, "step": 1}
    assert dtm.checkpoint.snapshot(state).wait().step == 0
    want = _values(m, opt)
    owners = sorted({p["owner"] for t in snapshots.find().doc["tensors"] for p in t["pieces"]})
    other = {"w": dtm.distribute(np.zeros_like(W), mesh, [dtm.Shard(1)]),
             "b": dtm.distribute(np.zeros_like(B), mesh, [dtm.Shard(0)]),
             "model": dtm.parallel.DDP(_model(3), mesh, axis="dp"), "step": None}
    other["optim"] = dtm.optim.AdamW(other["model"].parameters(), lr=1.0)
    dtm.checkpoint.load(other, "mem://")
    ok = [other["step"] == 1,
          np.array_equal(other["w"].local_shards()[r].numpy(), W[:, 3 * r:3 * r + 3]),
          np.array_equal(other["b"].local_shards()[r].numpy(), B[4 * r:4 * r + 4]),
          _equal(other["model"], other["optim"], want) == []]

    _train(m, opt, 1)
    state.update(w=dtm.distribute(W * 2, mesh, [dtm.Shard(0)]), step=2)
    real = dtm.store.MeshStore.put_array  # rank 1's fails: a put its store refuses

    def refused(self, key, a, dtype=None, *, ranks=None):
        raise DTMError(ErrorCode.STORE_IO_ERROR, f"put {key!r}: injected failure of rank 1's store")

    if r == 1:
        dtm.store.MeshStore.put_array = refused
    h = dtm.checkpoint.snapshot(state)  # rank 0's pieces go out, rank 1's do not
    try:
        h.wait()
        failed = None
    except DTMError as e:
        failed = [e.code.value, str(e)]
    dtm.store.MeshStore.put_array = real
    ok.append(h.done())
    pg.barrier()
    again = {"w": dtm.distribute(np.zeros_like(W), mesh, [dtm.Replicate()]), "step": None}
    dtm.checkpoint.load(again, "mem://", strict=False)
    ok += [again["step"] == 1, np.array_equal(again["w"].local_shards()[r].numpy(), W), snapshots.snapshots() == [0]]
    left = sorted(k for k in dtm.store.mesh().keys("snapshot/1"))
    pg.barrier()  # both looked before either snapshots again
    # taken again, the step is complete and used
    assert dtm.checkpoint.snapshot(state, step=1).wait().step == 1
    dtm.checkpoint.load(again, "mem://", strict=False)
    ok += [again["step"] == 2, np.array_equal(again["w"].local_shards()[r].numpy(), W * 2),
           snapshots.snapshots() == [0, 1]]
    # a training loop's: each snapshot completes the one before it; the two newest are kept
    state["step"] = 3
    first = dtm.checkpoint.snapshot(state)
    second = dtm.checkpoint.snapshot(state)
    ok += [first.done() and not second.done(), snapshots.snapshots() == [1, 2]]
    second.wait()
    ok += [snapshots.snapshots() == [2, 3], sorted(dtm.store.mesh().keys("snapshot/")) ==
           [f"snapshot/{s}/rank-{o}" for s in (1, 2, 3) for o in range(2)]]  # each put removed its slot's last
    pg.barrier()  # both listed the keys before either leaves (and removes its part of the store)
    _report(rank=r, ok=ok, failed=failed, owners=owners, left=left)
    dtm.shutdown()


def test_two_ranks_reload_with_other_placements_and_never_use_an_incomplete_snapshot():
    proc, res = _launch(2, ["two"])
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0 and sorted(res) == [0, 1], out
    for r, d in res.items():
        assert d["ok"] == [True] * 15, (r, d)
        assert d["owners"] == [0, 1], d  # the replicated model's pieces are shared out between the writers
        assert d["left"] == [], d  # the failed snapshot's pieces were removed
    assert res[1]["failed"][0] == "E1104" and "injected failure" in res[1]["failed"][1], res[1]
    assert res[0]["failed"][0] == "E1406" and "rank 1: E1104" in res[0]["failed"][1], res[0]


def three_ranks_main() -> None:
    """Three ranks (elastic): w sharded by rows, a model with AdamW state replicated. Snapshots
    1 and 2; in snapshot 3 rank 2 SIGKILLs itself once its pieces are out. The survivors'
    snapshot 3 fails, and each loads snapshot 2 whole into a state on no mesh: every value,
    rank 2's pieces included, is the one saved."""
    import dtm
    snapshots = importlib.import_module("dtm.ckpt.snapshot")  # (dtm.ckpt.snapshot is the function)
    from dtm.errors import DTMError

    pg, mesh, m, opt = _three_ranks()
    r = pg.rank
    want = {}
    for step in (1, 2, 3):
        _train(m, opt, step)
        state = {"w": dtm.distribute(W * step, mesh, [dtm.Shard(0)]), "model": m, "optim": opt, "step": step}
        if step == 3 and r == 2:
            put = snapshots._put

            def put_then_die(*args):
                put(*args)
                os.kill(os.getpid(), signal.SIGKILL)

            snapshots._put = put_then_die
        if step == 2:
            want = _values(m, opt)
        try:
            dtm.checkpoint.snapshot(state, step=step).wait()
            failed = None
        except DTMError as e:
            failed = [e.code.value, str(e)]
    doc, holders = snapshots.find().doc, snapshots.find().snap.holders
    owned_by_2 = sorted(t["name"] for t in doc["tensors"] for p in t["pieces"] if p["owner"] == 2)
    fresh, state = _loaded_on_no_mesh()
    ok = [state["step"] == 2, state["w"].device_mesh is None, np.array_equal(state["w"].numpy(), W * 2),
          _equal(fresh, state["optim"], want) == []]
    _report(rank=r, ok=ok, failed=failed, owned_by_2=owned_by_2, held=snapshots.snapshots(), holders=holders,
            lost=sorted(pg.membership.lost))
    _survivor_exit(r)


def _three_ranks():
    """This rank's process group (elastic) of three, its mesh dp=3, and a model with AdamW."""
    import dtm

    pg = dtm.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S, elastic=True)
    m = _model(0)
    return pg, dtm.Mesh({"dp": 3}), m, dtm.optim.AdamW(m.parameters(), lr=1e-2)


def _loaded_on_no_mesh():
    """A fresh model and the state {w, model, optim, step} on no mesh, loaded from the newest
    complete in-memory snapshot."""
    import dtm

    fresh = _model(9)
    state = {"w": dtm.zeros(9, 6), "model": fresh, "optim": dtm.optim.AdamW(fresh.parameters(), lr=1.0),
             "step": None}
    dtm.checkpoint.load(state, "mem://")
    return fresh, state


def _survivor_exit(r: int) -> None:
    """End survivor `r` of ranks 0 and 1 once both have read: a survivor's part of the store
    goes with its process (no barrier without rank 2 on this mesh; files in the test's
    directory instead)."""
    done = pathlib.Path(sys.argv[2])
    (done / f"rank-{r}").touch()
    deadline = time.monotonic() + PG_TIMEOUT_S
    while not all((done / f"rank-{s}").exists() for s in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)  # the mesh lost a rank: no orderly shutdown to wait for


def test_survivors_of_a_sigkill_load_the_lost_ranks_pieces_from_their_replicas(tmp_path):
    proc, res = _launch(3, ["three", str(tmp_path)], "--grace", "2")
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 128 + signal.SIGKILL, out  # rank 2's status
    assert sorted(res) == [0, 1], out
    for r, d in res.items():
        assert d["ok"] == [True] * 4, (r, d)
        assert d["held"] == [1, 2] and d["lost"] == [2], d
        assert d["failed"][0] == "E1001" and "snapshot 3 was not taken, the earlier snapshots [1, 2] are kept" \
            in d["failed"][1], d  # rank 2 was lost during its all_gather
        assert "w" in d["owned_by_2"] and any(n.startswith(("model/", "optim/")) for n in d["owned_by_2"]), d
        # each rank's blob in its own memory and the next rank's part: rank 2's from rank 0's part,
        # rank 1's (its only replica was on rank 2) from rank 1's own, published once rank 2 was lost
        assert d["holders"] == {"0": [0, 1], "1": [1, 2], "2": [2, 0]}, d


def mirrors_main() -> None:
    """Three ranks (elastic), data parallel: a model (on no mesh: every process holds it),
    its AdamW state and w, all replicated. Each writer's blob is mirrored by the next rank,
    which packs it from its own replica: no blob goes over the wire. Rank 2 SIGKILLs itself after snapshot 2; the
    survivors load snapshot 2, rank 2's pieces from rank 0's mirror (published into rank
    0's part on the loss, where rank 1 reads them). Rank 0 publishes 1 s late: rank 1 must
    wait for the live mirror though the writer is gone (it once gave up at once, E1405)."""
    import dtm
    snapshots = importlib.import_module("dtm.ckpt.snapshot")  # (dtm.ckpt.snapshot is the function)

    pg, mesh, m, opt = _three_ranks()
    r = pg.rank
    puts = []
    put = snapshots._put
    snapshots._put = lambda *a: puts.append(1) or put(*a)
    if r == 0:
        publish = snapshots._publish
        snapshots._publish = lambda *a: time.sleep(1.0) or publish(*a)
    want = {}
    for step in (1, 2):
        _train(m, opt, step)
        state = {"w": dtm.distribute(W * step, mesh, [dtm.Replicate()]), "model": m, "optim": opt, "step": step}
        dtm.checkpoint.snapshot(state, step=step).wait()
        want = _values(m, opt)
    if r == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + PG_TIMEOUT_S
    while 2 not in pg.membership.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    snap = snapshots.find().snap
    fresh, state = _loaded_on_no_mesh()
    owned_by_2 = sorted(t["name"] for t in snap.doc["tensors"] for p in t["pieces"] if p["owner"] == 2)
    ok = [state["step"] == 2, np.array_equal(state["w"].numpy(), W * 2), _equal(fresh, state["optim"], want) == []]
    _report(rank=r, ok=ok, puts=len(puts), holders=snap.holders, kept=sorted(snap.blobs), owned_by_2=owned_by_2)
    _survivor_exit(r)


def test_replicated_state_is_mirrored_in_memory_not_put_and_survives_a_loss(tmp_path):
    proc, res = _launch(3, ["mirrors", str(tmp_path)], "--grace", "2")
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 128 + signal.SIGKILL, out  # rank 2's status
    assert sorted(res) == [0, 1], out
    for r, d in res.items():
        assert d["ok"] == [True] * 3, (r, d)
        assert d["puts"] == 0, d  # every blob mirrored, none put
        assert d["owned_by_2"], d  # rank 2 wrote pieces, which its mirror (rank 0) gave back
        assert d["holders"] == {"0": [0, 1], "1": [1, 2], "2": [2, 0]}, d
        assert d["kept"] == sorted({r, (r - 1) % 3}), d  # its own blob and the previous rank's mirror


if __name__ == "__main__":
    {"two": two_ranks_main, "three": three_ranks_main, "mirrors": mirrors_main}[sys.argv[1]]()
