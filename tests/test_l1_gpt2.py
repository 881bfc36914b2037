"""Runtime L1: the partitioned programs of dtm.parallel run unchanged over processes. One
AdamW training step of a small GPT-2 with DP=2 x TP=2 over 4 processes (`dtm launch`, real
processes on 127.0.0.1) gives the loss and updated weights of the same step on one device,
computed here in the test process; so do two steps of the same training step under
dtm.jit (traced once, replayed: the weights and AdamW state updated in place on every
rank). Run as a script, this file is one rank's side."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
TIMEOUT_S = 120  # the whole launch: compiling the step on 4 processes sharing 2 cores


def _model_and_step():
    import dtm
    from dtm.models.gpt2 import GPT2, GPT2Config
    from dtm.nn.functional import cross_entropy

    config = GPT2Config(vocab_size=101, n_positions=16, n_embd=32, n_layer=1, n_head=4)  # 101: uneven shards
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (4, 9))

    def model():
        dtm.manual_seed(0)
        return GPT2(config)

    def step(net, params) -> float:
        opt = dtm.optim.AdamW(params, lr=1e-2)
        loss = cross_entropy(net(ids[:, :-1]).reshape(-1, config.vocab_size), dtm.tensor(ids[:, 1:].reshape(-1)))
        loss.backward()
        opt.step()
        return loss.item()

    return model, step


def _jitted_steps(net, params, ids: np.ndarray, vocab: int, n: int = 2) -> list[float]:
    """`n` AdamW steps of the whole training step as one dtm.jit program."""
    import dtm
    from dtm.nn.functional import cross_entropy

    opt = dtm.optim.AdamW(params, lr=1e-2)

    @dtm.jit
    def train_step(x, y):
        loss = cross_entropy(net(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x, y = dtm.tensor(ids[:, :-1]), dtm.tensor(ids[:, 1:])
    return [train_step(x, y).item() for _ in range(n)]


def rank_main(out: str) -> None:
    """One rank: DP=2 x TP=2 over the 4 processes; rank 0 writes the loss and weights."""
    import dtm
    from dtm.parallel import DDP, GPT2_PLAN, tensor_parallel

    pg = dtm.runtime.process_group.init(timeout=60)
    model, step = _model_and_step()
    m = model()
    params = list(m.parameters())
    mesh = dtm.Mesh({"dp": 2, "tp": 2})
    assert mesh.process is pg and mesh.rank == pg.rank
    net = DDP(tensor_parallel(m, mesh, GPT2_PLAN), mesh)
    loss = step(net, params)
    pieces = {name: p for name, p in m.state_dict().items()}
    assert all(p.device_mesh is mesh for p in pieces.values())
    full = {name: p.numpy() for name, p in pieces.items()}  # gathered from every rank
    m2 = model()
    ids = np.random.default_rng(0).integers(0, m2.config.vocab_size, (4, 9))
    losses = _jitted_steps(DDP(tensor_parallel(m2, mesh, GPT2_PLAN), mesh), list(m2.parameters()), ids,
                           m2.config.vocab_size)
    full.update({f"jit.{name}": p.numpy() for name, p in m2.state_dict().items()})
    if pg.rank == 0:
        np.savez(out, loss=np.float64(loss), jit_losses=np.array(losses), **full)


def launch_four(script: pathlib.Path, out: pathlib.Path, *options: str):
    """Run `script out` as 4 ranks with `dtm launch` (bounded by TIMEOUT_S); rank 0's saved results."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1")
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "4", *options, str(script), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return np.load(out, allow_pickle=False)


def assert_equals_one_device_step(got) -> None:
    """Rank 0's loss and gathered weights equal the same step run here, on one device."""
    model, step = _model_and_step()
    m = model()
    want_loss = step(m, list(m.parameters()))
    want = {k: v.numpy() for k, v in m.state_dict().items()}
    assert abs(float(got["loss"]) - want_loss) < 1e-5
    assert set(want) <= set(got.files) <= set(want) | {f"jit.{k}" for k in want} | {"loss", "jit_losses"}
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-4, err_msg=name)


def assert_equals_one_device_eager_steps(got) -> None:
    """Rank 0's jitted losses and weights equal two eager steps run here, on one device."""
    import dtm
    from dtm.nn.functional import cross_entropy

    model, _ = _model_and_step()
    m = model()
    opt = dtm.optim.AdamW(list(m.parameters()), lr=1e-2)
    ids = np.random.default_rng(0).integers(0, m.config.vocab_size, (4, 9))
    losses = []
    for _ in range(2):
        loss = cross_entropy(m(ids[:, :-1]).reshape(-1, m.config.vocab_size), dtm.tensor(ids[:, 1:].reshape(-1)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    np.testing.assert_allclose(got["jit_losses"], losses, rtol=1e-5)
    for name, w in m.state_dict().items():
        np.testing.assert_allclose(got[f"jit.{name}"], w.numpy(), rtol=1e-4, atol=1e-4, err_msg=name)


def test_gpt2_dp2_tp2_over_four_processes_equals_one_device(tmp_path):
    got = launch_four(HERE, tmp_path / "rank0.npz", "--axes", "dp=2,tp=2")
    assert_equals_one_device_step(got)
    assert_equals_one_device_eager_steps(got)


if __name__ == "__main__":
    rank_main(sys.argv[1])
