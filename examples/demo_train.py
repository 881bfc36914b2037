"""The training stage of `make demo` (examples/demo.py runs it): the byte-level GPT of
examples/demo_corpus.py trained from the store's batches with DP x TP over the launch's mesh,
inside `dtm.elastic.steps`, with an async checkpoint every `--save-every` steps and an
in-memory snapshot every step.

    dtm launch -n 4 --axes dp=2,tp=2 --elastic 2:8 examples/demo_train.py --store DIR --ckpt DIR \\
        [--steps 120] [--kill 3:8] [--out losses.json]
    python examples/demo_train.py --store DIR --steps 120 --out want.json   # one process, same steps
    python examples/demo_train.py --store DIR --ckpt DIR --resume --steps 1000  # on from the newest checkpoint

`--kill RANK:STEP`: the process of rank RANK (first epoch) SIGKILLs itself at step STEP.
`--resume`: load the newest checkpoint under `--ckpt` (whatever mesh saved it) into this
mesh and go on from its step. Rank 0 prints progress; at the end it writes {"losses": {step:
loss}, "resized_at": [step, ...], "resizes": [...]} to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import dtm  # noqa: E402
from dtm.models.gpt2 import GPT2  # noqa: E402
from dtm.nn import functional as NF  # noqa: E402
from dtm.parallel import DDP, GPT2_PLAN, tensor_parallel  # noqa: E402
from demo_corpus import DEMO, VOCAB, loader, model_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--save-every", type=int, default=40)
    ap.add_argument("--kill", default=None, metavar="RANK:STEP")
    ap.add_argument("--resume", action="store_true", help="go on from the newest checkpoint under --ckpt")
    ap.add_argument("--print-every", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = DEMO
    dtm.manual_seed(cfg.seed)
    model = GPT2(model_config(cfg))
    model.train()
    pg = dtm.init()
    net = model
    if pg.world_size > 1 or pg.joined_running:
        mesh = dtm.Mesh(pg.axes or {"dp": pg.world_size})
        net = DDP(tensor_parallel(model, mesh, GPT2_PLAN) if "tp" in mesh.shape else model, mesh)
    opt = dtm.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    batches = loader("corpus", cfg.batch_size, cfg.block_size, cfg.seed, store=dtm.store.open(args.store))
    kill = tuple(int(v) for v in args.kill.split(":")) if args.kill else None
    first_rank = pg.rank
    if pg.rank == 0 and not pg.joined_running and os.environ.get("DTM_COORDINATOR"):
        print(f"coordinator {os.environ['DTM_COORDINATOR']}", flush=True)

    @dtm.jit
    def train_step(x, y):
        loss = NF.cross_entropy(net(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses: dict[int, float] = {}
    state = {"model": model, "optim": opt, "loader": batches}
    start = 0
    if args.resume:  # resharded from the mesh that saved it onto this one
        dtm.checkpoint.load(state, args.ckpt)
        start = dtm.checkpoint.list(args.ckpt)[-1].step
    it = iter(batches)
    save = saved = None
    t0 = time.perf_counter()
    for step in dtm.elastic.steps(state, total=args.steps, snapshot_every=1, start=start):
        if kill is not None and (first_rank, step, pg.epoch) == (kill[0], kill[1], 1):
            print(f"rank {pg.rank}: killing myself (SIGKILL) at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = next(it)
        losses[step] = train_step(x, y).item()
        if args.ckpt and step % args.save_every == args.save_every - 1:
            if save is not None:
                save.wait()
            save, saved = dtm.checkpoint.save(state, args.ckpt, step=step + 1), step + 1  # async: training goes on
        if pg.rank == 0 and (step % args.print_every == 0 or step == args.steps - 1):
            where = f"epoch {pg.epoch} mesh {dict(pg.axes) or pg.world_size}" if pg.world_size > 1 else "one process"
            print(f"{where} step {step:4d} loss {losses[step]:.4f} "
                  f"{time.perf_counter() - t0:6.1f} s", flush=True)
    if save is not None:
        save.wait()
    if args.ckpt and saved != args.steps:
        dtm.checkpoint.save(state, args.ckpt, step=args.steps).wait()
    if pg.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": {str(k): v for k, v in sorted(losses.items())},
                       "resized_at": [r.step for r in dtm.elastic.history],
                       "resizes": [repr(r) for r in dtm.elastic.history]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
