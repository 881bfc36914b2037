"""A tiny character-level GPT-2 trained on four of Shakespeare's sonnets (public domain,
shipped in data/sonnets.txt): the smallest real training job, used by tests, examples
and the demo.

    model, losses = train(steps=300)
    print(sample(model, "Shall I", 100))
"""

from __future__ import annotations

import pathlib
import sys
import time
from dataclasses import dataclass

import numpy as np

from .. import optim
from ..nn import functional as NF
from ..tensor import manual_seed, tensor
from .gpt2 import GPT2, GPT2Config

TEXT = (pathlib.Path(__file__).parent / "data" / "sonnets.txt").read_text(encoding="utf-8")


class CharTokenizer:
    def __init__(self, text: str = TEXT):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> np.ndarray:
        return np.array([self.index[c] for c in s], dtype=np.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in np.asarray(ids).reshape(-1))


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 8
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 48
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0


def model_config(cfg: TrainConfig, tok: CharTokenizer) -> GPT2Config:
    return GPT2Config(vocab_size=tok.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                      n_layer=cfg.n_layer, n_head=cfg.n_head)


def batches(cfg: TrainConfig, tok: CharTokenizer):
    """Random windows of the text, from a seeded generator: (inputs, next-char targets)."""
    data = tok.encode(TEXT)
    rng = np.random.default_rng(cfg.seed)
    while True:
        starts = rng.integers(0, len(data) - cfg.block_size - 1, size=cfg.batch_size)
        x = np.stack([data[s:s + cfg.block_size] for s in starts])
        y = np.stack([data[s + 1:s + cfg.block_size + 1] for s in starts])
        yield x, y


def train(cfg: TrainConfig | None = None, progress: bool = False, model: GPT2 | None = None):
    """Train with AdamW and a cosine schedule; returns (model, per-step losses)."""
    cfg = cfg or TrainConfig()
    tok = CharTokenizer()
    manual_seed(cfg.seed)
    model = model or GPT2(model_config(cfg, tok))
    model.train()
    opt = optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps, eta_min=cfg.lr / 10)
    losses = []
    t0 = time.perf_counter()
    for step, (x, y) in zip(range(cfg.steps), batches(cfg, tok)):
        logits = model(x)
        loss = NF.cross_entropy(logits.reshape(-1, tok.vocab_size), tensor(y).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress and (step % 10 == 0 or step == cfg.steps - 1):
            rate = (step + 1) * cfg.batch_size * cfg.block_size / (time.perf_counter() - t0)
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {rate:,.0f} tokens/s", file=sys.stderr, flush=True)
    return model, losses


def sample(model: GPT2, prompt: str, n: int, temperature: float = 0.8, top_k: int | None = 10) -> str:
    tok = CharTokenizer()
    ids = tok.encode(prompt)[None]
    window = model.config.n_positions
    out = model.generate(ids[:, -window:], max_new_tokens=min(n, window - ids.shape[1]), do_sample=True,
                         temperature=temperature, top_k=top_k)
    return tok.decode(out.numpy()[0])
