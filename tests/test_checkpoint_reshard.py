"""Checkpoints reshard on load (spec 9.4, issue 31's matrix): a small GPT-2 (vocabulary 65,
divisible by neither 2, 3 nor 4) with AdamW state and a dtm.data Loader in `state`, trained
for K steps with DP=2 x TP=2 over 4 processes (`dtm launch`, real processes on 127.0.0.1),
saved, then loaded and trained M more steps on: the same mesh (the losses of the
uninterrupted run exactly), DP=4 with FSDP over 4 processes, TP=2 over 2 processes, FSDP
over 3 processes (uneven shards), one process with no mesh, and DP=2 x TP=4 on 8 virtual L0
devices in this process. Every resumed run's losses equal those of an uninterrupted run of
the same batches on one device, which is itself checked against PyTorch (transformers'
GPT2LMHeadModel and torch.optim.AdamW from the same weights and batches).

Run as a script, this file is one rank's side: `MODE ROOT DATA OUT`."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
TIMEOUT_S = 420    # one launch: compiling 3 training steps on 4 processes sharing 2 busy cores
PG_TIMEOUT_S = 180  # joining the mesh and every collective wait of a rank

VOCAB = 65
BATCH, BLOCK = 12, 8  # 12 rows: split evenly over dp = 1, 2, 3 and 4
K, M = 2, 2           # steps before the save, steps after the load
LR, WEIGHT_DECAY = 1e-2, 0.1
TOL = dict(rtol=2e-4, atol=2e-5)  # another mesh sums in another order: float rounding only


def tokens(data: bytes) -> np.ndarray:
    """The ingest function: each byte a token id below VOCAB."""
    return np.frombuffer(data, np.uint8).astype(np.int64) % VOCAB


def make_data(where: pathlib.Path) -> str:
    """A token store of three documents; its directory."""
    import dtm
    from dtm.data import ingest

    docs = []
    for i in range(3):
        p = where / f"doc{i}.txt"
        p.write_bytes(bytes((37 * j * (i + 3) + j // 7) % 251 for j in range(700 + 90 * i)))
        docs.append(str(p))
    st = dtm.store.open(where / "tokens")
    ingest(docs, tokens, "tok", workers=0, store=st)
    st.close()
    return str(where / "tokens")


def build(layout: str, mesh, data: str, seed: int) -> tuple:
    """(state, net): the model (initial weights from `seed`) parallelized as `layout` says
    on `mesh`, its AdamW and a fresh Loader, as checkpoint state."""
    import dtm
    from dtm.models.gpt2 import GPT2, GPT2Config
    from dtm.parallel import DDP, GPT2_PLAN, fsdp, tensor_parallel

    dtm.manual_seed(seed)
    model = GPT2(GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=24, n_layer=1, n_head=4))
    params = list(model.parameters())
    net = {"one": lambda: model, "tp": lambda: tensor_parallel(model, mesh, GPT2_PLAN),
           "dp_tp": lambda: DDP(tensor_parallel(model, mesh, GPT2_PLAN), mesh),
           "fsdp": lambda: fsdp(model, mesh)}[layout]()
    opt = dtm.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    loader = dtm.data.Loader(data, "tok", BATCH, BLOCK, seed=5)
    return {"model": model, "optim": opt, "loader": loader, "step": 0}, net


def train(state: dict, net, steps: int) -> list[float]:
    """`steps` AdamW steps on the loader's next batches; their losses."""
    from dtm.nn.functional import cross_entropy

    opt, losses = state["optim"], []
    for _ in range(steps):
        x, y = next(state["loader"])
        loss = cross_entropy(net(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        state["step"] += 1
    return losses


def resume(layout: str, mesh, root: str, data: str) -> list[float]:
    """Load the checkpoint into a fresh model of other initial weights laid out as `layout`
    says, and train M steps; their losses."""
    import dtm

    state, net = build(layout, mesh, data, seed=1)
    dtm.checkpoint.load(state, root)
    assert state["step"] == K and state["loader"].step == K, (state["step"], state["loader"].step)
    losses = train(state, net, M)
    state["loader"].close()
    return losses


def rank_main(mode: str, root: str, data: str, out: str) -> None:
    import dtm

    pg = dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    got = {}
    if mode == "save":  # 4 processes: train on DP=2 x TP=2, save, go on; resume on the same mesh and on FSDP=4
        mesh = dtm.Mesh({"dp": 2, "tp": 2})
        state, net = build("dp_tp", mesh, data, seed=0)
        first = train(state, net, K)
        dtm.checkpoint.save(state, root, step=K).wait(PG_TIMEOUT_S)
        got["uninterrupted"] = first + train(state, net, M)
        state["loader"].close()
        got["dp_tp"] = resume("dp_tp", mesh, root, data)
        got["fsdp4"] = resume("fsdp", dtm.Mesh({"dp": 4}), root, data)
    elif mode == "tp2":
        got["tp2"] = resume("tp", dtm.Mesh({"tp": 2}), root, data)
    elif mode == "fsdp3":
        got["fsdp3"] = resume("fsdp", dtm.Mesh({"dp": 3}), root, data)
    if pg.rank == 0:
        np.savez(out, **{k: np.array(v) for k, v in got.items()})


def launch(n: int, mode: str, root: pathlib.Path, data: str, out: pathlib.Path) -> dict:
    """Run this file as `n` ranks in `mode` (bounded by TIMEOUT_S); rank 0's losses."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1")
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", str(n), "--join-timeout", str(PG_TIMEOUT_S),
           str(HERE), mode, str(root), data, str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with np.load(out, allow_pickle=False) as f:
        return {k: f[k].tolist() for k in f.files}


def torch_losses(data: str, steps: int) -> list[float]:
    """The same model, batches and AdamW in PyTorch (transformers' GPT-2), from the same
    initial weights: the losses of `steps` steps."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import dtm
    from test_char_gpt import _torch_twin  # this folder is on sys.path

    state, _ = build("one", None, data, seed=0)
    hf = _torch_twin(state["model"])
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    loader = dtm.data.Loader(data, "tok", BATCH, BLOCK, seed=5, numpy=True)
    losses = []
    for _ in range(steps):
        x, y = next(loader)
        loss = torch.nn.functional.cross_entropy(hf(torch.from_numpy(x)).logits.reshape(-1, VOCAB),
                                                 torch.from_numpy(y).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    loader.close()
    state["loader"].close()
    return losses


def test_loader_state_resumes_its_batches_and_refuses_another_order(tmp_path):
    import dtm
    from dtm.errors import ErrorCode

    data = make_data(tmp_path)
    a = dtm.data.Loader(data, "tok", BATCH, BLOCK, seed=5, numpy=True)
    batches = [next(a) for _ in range(5)]
    saved = a.state_dict()
    assert saved["step"] == 5
    b = dtm.data.Loader(data, "tok", BATCH, BLOCK, seed=5, numpy=True)
    next(b)  # a prefetching thread already ahead of the position loaded below
    b.load_state_dict({**saved, "step": 2})
    for want in batches[2:]:
        got = next(b)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    other = dtm.data.Loader(data, "tok", BATCH, BLOCK, seed=6, numpy=True)
    with pytest.raises(dtm.DTMError) as e:
        other.load_state_dict(saved)
    assert e.value.code == ErrorCode.ATTRIBUTE_VALUE and "seed saved 5, here 6" in str(e.value)
    for loader in (a, b, other):
        loader.close()


def test_dp2_tp2_checkpoint_resumes_on_every_other_mesh_with_the_same_losses(tmp_path):
    import dtm

    data = make_data(tmp_path)
    root = tmp_path / "run"
    got = launch(4, "save", root, data, tmp_path / "save.npz")
    (ckpt,) = dtm.checkpoint.list(root)
    assert ckpt.step == K and ckpt.mesh == "dp=2 x tp=2"
    placements = {t["name"]: t["placements"] for t in dtm.checkpoint.read_manifest(root)["tensors"]}
    assert placements["model/wte.weight"] == ["replicate", "shard(0)"]  # vocab-parallel: 33 and 32 rows
    got.update(launch(2, "tp2", root, data, tmp_path / "tp2.npz"))
    got.update(launch(3, "fsdp3", root, data, tmp_path / "fsdp3.npz"))

    # The uninterrupted reference: one device, this process, checked against PyTorch once.
    state, net = build("one", None, data, seed=0)
    want = train(state, net, K + M)
    state["loader"].close()
    np.testing.assert_allclose(want, torch_losses(data, K + M), rtol=1e-4)

    np.testing.assert_allclose(got["uninterrupted"], want, **TOL)
    assert got["dp_tp"] == got["uninterrupted"][K:]  # the same mesh: exactly
    got["one"] = resume("one", None, str(root), data)
    dtm.devices(8)
    got["l0_dp2_tp4"] = resume("dp_tp", dtm.Mesh({"dp": 2, "tp": 4}), str(root), data)
    for name in ("fsdp4", "tp2", "fsdp3", "one", "l0_dp2_tp4"):
        np.testing.assert_allclose(got[name], want[K:], **TOL, err_msg=name)

    # The tolerance sees the AdamW state: resumed without it, the losses leave it.
    state, net = build("one", None, data, seed=1)
    dtm.checkpoint.load({"model": state["model"], "loader": state["loader"]}, root, strict=False)
    without_optim = train(state, net, M)
    state["loader"].close()
    assert not np.allclose(without_optim, want[K:], **TOL), (without_optim, want[K:])


if __name__ == "__main__":
    rank_main(*sys.argv[1:5])
