"""An elastic training job for tests/test_elastic.py and benchmarks/elastic.py: the char GPT
trained with DDP x tensor parallel over the launch's mesh axes inside `dtm.elastic.steps`.

    dtm launch -n 4 --axes dp=2,tp=2 --elastic 2:8 tests/elastic_train.py --steps 12 \\
        --kill 3:4 --out losses.json
    python tests/elastic_train.py --steps 12 --out want.json      # the same steps on one process

`--kill RANK:STEP[:EPOCH]` makes the process that is rank RANK of epoch EPOCH (default 1)
SIGKILL itself at the start of step STEP (`+N`: the epoch's first step plus N): a real
death, which the others survive (they are in the step's collectives when it dies); with
`--hang` it stops instead (SIGSTOP), a hang that only the heartbeat bound reveals.
`--die-resizing RANK`: that rank's process dies as its first resize starts (a second
failure while the mesh re-forms). `--slow-publish RANK:SECONDS`: once a rank is lost, the
process of rank RANK of the first epoch waits that long before each snapshot blob it
publishes (a survivor slow to publish: its peers must wait for the blobs, not read others).
Batch i is a function of the seed and i alone (`Batches`, whose state travels in the
snapshot), so every run sees the same global batches whatever its mesh.
Rank 0 of the last epoch writes {"losses": {step: loss}, "resizes": [...]} to `--out`;
every rank prints one line per step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

import dtm
from dtm.models.char_gpt import TEXT, CharTokenizer, TrainConfig, model_config
from dtm.models.gpt2 import GPT2, GPT2Config
from dtm.nn import functional as NF
from dtm.parallel import DDP, GPT2_PLAN, tensor_parallel
from dtm.runtime import process_group


class Batches:
    """Global batch i: `batch` windows of the corpus at offsets drawn from (seed, i); with no
    corpus (`data` None), `batch` rows of random tokens below `vocab` drawn from (seed, i)."""

    def __init__(self, cfg: TrainConfig, data: np.ndarray | None, vocab: int):
        self.cfg, self.data, self.vocab, self.i = cfg, data, vocab, 0

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng((self.cfg.seed, self.i))
        self.i += 1
        if self.data is None:
            rows = rng.integers(0, self.vocab, (self.cfg.batch_size, self.cfg.block_size + 1))
            return rows[:, :-1], rows[:, 1:]
        at = rng.integers(0, len(self.data) - self.cfg.block_size - 1, self.cfg.batch_size)
        x = np.stack([self.data[a:a + self.cfg.block_size] for a in at])
        y = np.stack([self.data[a + 1:a + 1 + self.cfg.block_size] for a in at])
        return x, y

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, d: dict) -> None:
        self.i = int(d["i"])


def _die_resizing() -> None:
    """SIGKILL this process as its first resize starts (before it publishes or carries
    anything): a rank lost while the mesh re-forms."""
    resize = dtm.elastic._resize

    def die(*a, **k):
        print(f"dying inside the resize at t={time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        return resize(*a, **k)

    dtm.elastic._resize = die


def _slow_publish(seconds: float) -> None:
    """Make this process put each snapshot blob `seconds` late once a rank is lost (its
    publication, dtm.ckpt.snapshot._publish: one blob after the other, so a reader gets the
    first blobs of the older snapshot while the newer one's are still to come)."""
    put_array = dtm.store.MeshStore.put_array

    def slow(self, key, *a, **k):
        if key.startswith("snapshot/") and process_group.current().membership.lost:
            time.sleep(seconds)
        return put_array(self, key, *a, **k)

    dtm.store.MeshStore.put_array = slow


def _kill_now(kill: tuple[str, str, str], pg, step: int) -> bool:
    """Whether `--kill` RANK:STEP:EPOCH names this rank, step and epoch."""
    rank, at, epoch = kill
    first = dtm.elastic.history[-1].step if dtm.elastic.history else 0  # (the epoch's first step)
    at_step = first + int(at[1:]) if at.startswith("+") else int(at)
    return (pg.rank, step, pg.epoch) == (int(rank), at_step, int(epoch))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill", default=None, metavar="RANK:STEP[:EPOCH]")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds each step waits (time to join)")
    ap.add_argument("--hang", action="store_true", help="--kill stops the process (SIGSTOP) instead: a hang")
    ap.add_argument("--die-resizing", type=int, default=None, metavar="RANK",
                    help="the process of rank RANK of the first epoch SIGKILLs itself as its first resize starts")
    ap.add_argument("--slow-publish", default=None, metavar="RANK:SECONDS",
                    help="once a rank is lost, the process of rank RANK of the first epoch puts each snapshot blob "
                    "SECONDS late")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", choices=("char", "gpt2"), default="char",
                    help="gpt2: GPT-2 124M on random tokens, 4 rows of 64 a step (benchmarks/elastic.py)")
    args = ap.parse_args()
    if args.model == "gpt2":
        cfg = TrainConfig(steps=args.steps, batch_size=4, block_size=64, lr=3e-4)
        config, data = GPT2Config(), None
    else:
        cfg, tok = TrainConfig(steps=args.steps, batch_size=8), CharTokenizer()
        config, data = model_config(cfg, tok), tok.encode(TEXT)
    dtm.manual_seed(cfg.seed)
    model = GPT2(config)
    model.train()
    pg = dtm.init()
    net = model
    if pg.world_size > 1 or pg.joined_running:
        mesh = dtm.Mesh(pg.axes or {"dp": pg.world_size})
        net = tensor_parallel(model, mesh, GPT2_PLAN) if "tp" in mesh.shape else model
        net = DDP(net, mesh) if "dp" in mesh.shape else net
    opt = dtm.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    batches = Batches(cfg, data, config.vocab_size)
    if pg.rank == 0 and not pg.joined_running:
        print(f"coordinator {os.environ.get('DTM_COORDINATOR', '')}", flush=True)
    kill = (*args.kill.split(":"), "1")[:3] if args.kill else None
    if args.die_resizing == pg.rank:  # a second failure, inside the resize of the first
        _die_resizing()
    slow_rank, _, seconds = (args.slow_publish or "").partition(":")
    if slow_rank and int(slow_rank) == pg.rank:
        _slow_publish(float(seconds))

    @dtm.jit
    def train_step(x, y):
        loss = NF.cross_entropy(net(x).reshape(-1, config.vocab_size), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses: dict[int, float] = {}
    state = {"model": model, "optim": opt, "batches": batches}
    for step in dtm.elastic.steps(state, total=cfg.steps, snapshot_every=1):
        if kill is not None and _kill_now(kill, pg, step):
            how = signal.SIGSTOP if args.hang else signal.SIGKILL
            print(f"{'stopping' if args.hang else 'killing'} myself at t={time.time():.3f}", flush=True)
            os.kill(os.getpid(), how)  # the others are inside the step's collectives by now
        x, y = next(batches)
        loss = train_step(dtm.tensor(x), dtm.tensor(y)).item()
        losses[step] = loss
        print(f"epoch {pg.epoch} rank {pg.rank}/{pg.world_size} {dict(pg.axes)} step {step} loss {loss:.6f} "
              f"t={time.time():.3f}", flush=True)
        if loss == loss:  # (a step that lost a peer ends at once, its loss NaN: no time to stand for)
            time.sleep(args.sleep)
    if pg.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": {str(k): v for k, v in sorted(losses.items())},
                       "resizes": [repr(r) for r in dtm.elastic.history], "epoch": pg.epoch,
                       "axes": dict(pg.axes)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
