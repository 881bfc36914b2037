"""Train the tiny character-level GPT with DP=2 x TP=2 over 4 processes, check it against a
single-process run of the same steps, and sample from it (what `make demo` runs).

    dtm launch -n 4 --axes dp=2,tp=2 examples/train_char_gpt_dist.py [--steps 150]

Every rank runs this same script. `dtm.Mesh` spans the processes: each keeps only its own
shard of every parameter (tensor parallel over tp, the batch split over dp). The training
step (forward, backward, AdamW) is one dtm.jit program: each rank partitions the traced
global-view step for itself once and replays the compiled step, whose collectives go
between the processes (dtm.runtime.l1) and whose updates write the shards in place. Rank 0 prints progress; at the end
it trains the same model on one process and exits non-zero if the losses differ.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import dtm
from dtm.models.char_gpt import CharTokenizer, TrainConfig, batches, model_config, sample, train
from dtm.models.gpt2 import GPT2
from dtm.nn import functional as NF
from dtm.parallel import DDP, GPT2_PLAN, tensor_parallel
from dtm.runtime import process_group

RTOL = 1e-3  # losses of the distributed run against the single-process one (relative)


def bytes_per_rank(pg: process_group.ProcessGroup) -> np.ndarray:
    """[[sent, received]] of every rank so far (a collective: every rank calls it)."""
    f = pg.figures()
    return pg.all_gather(np.array([[f.bytes_sent, f.bytes_received]], np.int64), dim=0)


def train_distributed(cfg: TrainConfig, pg: process_group.ProcessGroup, say) -> tuple[GPT2, list[float]]:
    """char_gpt.train's loop (same seed, data, AdamW and cosine schedule) on a dp x tp mesh."""
    tok = CharTokenizer()
    dtm.manual_seed(cfg.seed)
    model = GPT2(model_config(cfg, tok))
    model.train()
    mesh = dtm.Mesh({"dp": 2, "tp": 2})  # spans the 4 processes: mesh rank = process rank
    net = DDP(tensor_parallel(model, mesh, GPT2_PLAN), mesh)
    opt = dtm.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = dtm.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps, eta_min=cfg.lr / 10)
    @dtm.jit  # the whole step, forward to AdamW, is one program: traced once, then replayed
    def train_step(x, y):
        loss = NF.cross_entropy(net(x).reshape(-1, tok.vocab_size), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses: list[float] = []
    t0 = time.perf_counter()
    for step, (x, y) in zip(range(cfg.steps), batches(cfg, tok)):
        loss = train_step(dtm.tensor(x), dtm.tensor(y))
        sched.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == cfg.steps - 1:
            moved = bytes_per_rank(pg)
            rate = (step + 1) * cfg.batch_size * cfg.block_size / (time.perf_counter() - t0)
            per_rank = " ".join(f"{(s + r) / 1e6:.1f}" for s, r in moved)
            say(f"step {step:3d}  loss {losses[-1]:.4f}  {rate:7,.0f} tokens/s  MB moved per rank [{per_rank}]")
    return model, losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    args = ap.parse_args()
    pg = dtm.init()
    if pg.world_size != 4:
        print(f"run me with `dtm launch -n 4 --axes dp=2,tp=2`: this is a mesh of {pg.world_size}", file=sys.stderr)
        return 2
    say = (lambda s: print(s, flush=True)) if pg.rank == 0 else (lambda s: None)
    cfg = TrainConfig(steps=args.steps)
    say(f"training the char GPT for {cfg.steps} steps with DP=2 x TP=2 over {pg.world_size} processes")
    t0 = time.perf_counter()
    model, losses = train_distributed(cfg, pg, say)
    took = time.perf_counter() - t0
    state = {k: v.numpy() for k, v in model.state_dict().items()}  # gathered: every rank takes part
    if pg.rank != 0:
        return 0
    say(f"trained in {took:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    t1 = time.perf_counter()
    _, want = train(cfg)  # the same steps on this one process, no mesh
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
    say(f"single-process reference ({time.perf_counter() - t1:.1f} s): loss {want[0]:.3f} -> {want[-1]:.3f}; "
        f"largest relative difference over {len(want)} steps {diff:.2e} (tolerance {RTOL:g})")
    if not diff <= RTOL:
        say("MISMATCH: the distributed losses differ from the single-process run")
        return 1

    plain = GPT2(model.config)  # the trained weights, whole, on this process: sampling is serial
    plain.load_state_dict(state)
    plain.eval()
    dtm.manual_seed(1)
    for prompt in ("Shall I", "When I", "Thy "):
        say(f"sample: {sample(plain, prompt, 24)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
