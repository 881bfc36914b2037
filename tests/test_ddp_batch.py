"""DDP's batch across processes (dtm/parallel/ddp.py): every rank passes the same global
batch and DDP gives each its rows. Under `dtm launch -n 2`, a torch-style call that passes
each rank a batch of its own fails with E0803 at the caller's line, eagerly and under
dtm.jit (before the program runs: the weights stay as they were), instead of training on
half of each rank's rows, also when the jitted function slices the batch out of a larger
argument; the same batch on both ranks trains as numpy says. Run as a script, this file is
one rank's side."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
TIMEOUT_S = 120  # the whole launch, on a loaded 2-core machine

X = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)  # the global batch: 3 rows a rank
Y = np.random.default_rng(1).standard_normal((6, 2)).astype(np.float32)


def rank_main(out: str) -> None:
    import dtm
    from dtm import nn
    from dtm.errors import DTMError
    from dtm.parallel import DDP

    pg = dtm.init()
    dtm.manual_seed(0)
    model = nn.Linear(4, 2)
    w0, b0 = model.weight.numpy().copy(), model.bias.numpy().copy()
    net = DDP(model, dtm.Mesh({"dp": 2}))
    got: dict = {}

    def loss_of(x, y):
        return nn.functional.mse_loss(net(x), y)

    # the same batch on both ranks: the global program's loss and gradients
    loss = loss_of(dtm.tensor(X), dtm.tensor(Y))
    loss.backward()
    got["loss"] = float(loss.item())
    got["grad"] = model.weight.grad.full_tensor().numpy().tolist()
    model.weight.grad = model.bias.grad = None

    # a batch of each rank's own, eagerly
    mine = X + pg.rank
    try:
        loss_of(dtm.tensor(mine), dtm.tensor(Y))
        got["eager"] = None
    except DTMError as e:
        got["eager"] = [e.code.value, str(e)]
    got["eager_line"] = f"{HERE}:{_line('mse_loss(net(x)')}"  # (the innermost line of the caller's)
    try:  # a batch still to be computed (lazy) when DDP gets it
        loss_of(dtm.tensor(X) + pg.rank, dtm.tensor(Y))
        got["pending"] = None
    except DTMError as e:
        got["pending"] = [e.code.value, str(e)]

    # under dtm.jit: a step that updates the weights
    opt = dtm.optim.SGD(model.parameters(), lr=0.1)

    @dtm.jit
    def step(x, y):
        loss = loss_of(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    before = model.weight.full_tensor().numpy().copy()
    try:
        step(dtm.tensor(mine), dtm.tensor(Y))
        got["jit"] = None
    except DTMError as e:
        got["jit"] = [e.code.value, str(e)]
    got["unchanged"] = bool(np.array_equal(model.weight.full_tensor().numpy(), before))

    # a batch the jitted function slices from a larger argument (6000 values: too many to
    # recompute before each call), compared through that argument
    @dtm.jit
    def sliced(data):
        return loss_of(data[:, :4], dtm.tensor(Y))

    data = np.concatenate([X, np.zeros((6, 996), np.float32)], axis=1)
    got["sliced_same"] = float(sliced(dtm.tensor(data)).item())
    data[:, 4:] += pg.rank  # (the part the batch does not read differs: still refused)
    data[:, :4] += pg.rank
    try:
        sliced(dtm.tensor(data))
        got["sliced"] = None
    except DTMError as e:
        got["sliced"] = [e.code.value, str(e)]
    got["jit_loss"] = float(step(dtm.tensor(X), dtm.tensor(Y)).item())  # the same trace, the same batch: it runs
    got["stepped"] = model.weight.full_tensor().numpy().tolist()
    got["w0"], got["b0"] = w0.tolist(), b0.tolist()
    pathlib.Path(f"{out}.{pg.rank}").write_text(json.dumps(got))
    dtm.shutdown()


def _line(text: str) -> int:
    """The line of this file that holds `text` (the caller's line an error must name)."""
    return next(i for i, line in enumerate(HERE.read_text().splitlines(), 1) if text in line and "_line(" not in line)


def test_each_rank_passing_its_own_batch_is_an_error_not_half_the_data(tmp_path):
    out = tmp_path / "result"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTM_")}
    env.update(PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1")
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "2", str(HERE), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ranks = [json.loads(pathlib.Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    w, b = np.array(ranks[0]["w0"]), np.array(ranks[0]["b0"])
    err = X @ w.T + b - Y  # numpy's mean squared error of the global batch, and its gradient
    want_loss, want_grad = float((err ** 2).mean()), 2 * err.T @ X / err.size
    for got in ranks:
        assert abs(got["loss"] - want_loss) <= 1e-5 * want_loss, (got["loss"], want_loss)
        np.testing.assert_allclose(got["grad"], want_grad, rtol=1e-5, atol=1e-6)
        for what in ("eager", "pending", "jit", "sliced"):
            code, message = got[what]
            assert code == "E0803", got[what]
            assert "passed different batches" in message and "ranks [1] differ from rank 0" in message, message
        assert got["eager_line"] in got["eager"][1], (got["eager_line"], got["eager"][1])
        assert got["unchanged"], "the jitted step ran on the mismatched batches"
        np.testing.assert_allclose(got["jit_loss"], want_loss, rtol=1e-5)
        np.testing.assert_allclose(got["sliced_same"], want_loss, rtol=1e-5)  # (before the SGD step)
        np.testing.assert_allclose(got["stepped"], w - 0.1 * want_grad, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    rank_main(sys.argv[1])
