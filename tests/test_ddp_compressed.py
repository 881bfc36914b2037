"""DDP(compress="q8_0") end to end (spec 9.5.1): a small char GPT trained with DP=2 over two
real processes (`dtm launch -n 2`) for a few dozen steps, once with exact gradient
all_reduces and once with q8_0-compressed ones, from the same seed and the same batches.
The final losses agree within 2%, and the gradient buckets' all_reduces really travelled
compressed: about 3.8x fewer bytes on the wire (the transport's byte counters, per
collective), while the small ones (the loss) stayed exact.

The two ranks pretend to be on two hosts (a node id per rank), so every collective goes
over TCP, compressed or not, and the byte counts compare like with like. Run as a script,
this file is one rank's side."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
TIMEOUT_S = 150  # the whole launch, on a loaded 2-core machine
STEPS = 40


def _config():
    from dtm.models.char_gpt import TrainConfig
    return TrainConfig(steps=STEPS, batch_size=8, block_size=32, n_layer=2, n_head=4, n_embd=48, lr=3e-3)


def _train(compress: str | None, pg, records: list) -> list[float]:
    """char_gpt.train's loop (same seed, data, AdamW, cosine schedule) with DP=2 over the
    two processes; `records` gets (collective, elements, compress, bytes sent) of each
    collective the steps run."""
    import dtm
    from dtm.models.char_gpt import CharTokenizer, batches, model_config
    from dtm.models.gpt2 import GPT2
    from dtm.nn import functional as NF
    from dtm.parallel import DDP

    cfg, tok = _config(), CharTokenizer()
    dtm.manual_seed(cfg.seed)
    model = GPT2(model_config(cfg, tok))
    model.train()
    mesh = dtm.Mesh({"dp": 2})
    net = DDP(model, mesh, compress=compress)
    opt = dtm.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = dtm.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps, eta_min=cfg.lr / 10)

    @dtm.jit
    def train_step(x, y):
        loss = NF.cross_entropy(net(x).reshape(-1, tok.vocab_size), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses = []
    for _, (x, y) in zip(range(cfg.steps), batches(cfg, tok)):
        del records[:]  # only the last step's collectives: every step runs the same ones
        losses.append(train_step(dtm.tensor(x), dtm.tensor(y)).item())
        sched.step()
    return losses


def rank_main(out: str) -> None:
    import dtm.cluster.membership as membership
    rank = int(os.environ["DTM_RANK"])
    membership.node_id = lambda: f"test-host-{rank}"  # two "hosts": TCP, not shared memory

    import dtm
    pg = dtm.init()
    assert pg.world_size == 2
    tp = pg.comm.transport
    records: list = []
    collective = pg.collective

    def counted(name, x, group, **kw):
        before = tp.bytes_sent
        result = collective(name, x, group, **kw)
        records.append((name, int(x.size) if x is not None else 0, kw.get("compress"), tp.bytes_sent - before))
        return result

    pg.collective = counted
    result = {}
    for compress in (None, "q8_0"):
        losses = _train(compress, pg, records)
        result[str(compress)] = {"losses": losses, "collectives": list(records)}
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(result))


def test_ddp_q8_0_trains_char_gpt_like_the_exact_run_with_fewer_bytes(tmp_path):
    out = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1")
    env = {k: v for k, v in env.items() if not k.startswith("DTM_") or k in ("DTM_HOST",)}
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "2", str(HERE), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    got = json.loads(out.read_text())
    exact, q8 = got["None"], got["q8_0"]
    assert len(exact["losses"]) == len(q8["losses"]) == STEPS
    assert exact["losses"][-1] < 0.8 * exact["losses"][0]  # it learned something
    rel = abs(q8["losses"][-1] - exact["losses"][-1]) / exact["losses"][-1]
    assert rel <= 0.02, (rel, exact["losses"][-1], q8["losses"][-1])
    assert q8["losses"] != exact["losses"]  # the compressed gradients did change the numbers

    # One step's collectives: the same ones in both runs, the gradient buckets compressed.
    assert [c[:2] for c in exact["collectives"]] == [c[:2] for c in q8["collectives"]]
    grads = [i for i, c in enumerate(q8["collectives"]) if c[0] == "all_reduce" and c[1] >= 1024]
    assert grads, q8["collectives"]
    assert all(q8["collectives"][i][2] == "q8_0" for i in grads)
    assert all(c[2] is None for i, c in enumerate(q8["collectives"]) if i not in grads)
    assert all(c[2] is None for c in exact["collectives"])
    plain = sum(exact["collectives"][i][3] for i in grads)
    packed = sum(q8["collectives"][i][3] for i in grads)
    ratio = plain / packed
    assert 3.5 <= ratio <= 128 / 34, (ratio, plain, packed)  # 4-byte floats against 34-byte blocks of 32


if __name__ == "__main__":
    rank_main(sys.argv[1])
