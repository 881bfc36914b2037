"""Train the tiny character-level GPT on four of Shakespeare's sonnets with the reference
runtime, showing progress, then sample from it: the Tensor API, autodiff-as-IR, nn, optim
and GPT-2 end to end.

    python examples/train_char_gpt.py [--steps 200]
"""

from __future__ import annotations

import argparse
import time

from dtm.models.char_gpt import TrainConfig, sample, train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, losses = train(TrainConfig(steps=args.steps), progress=True)
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.1f} s: loss {losses[0]:.3f} -> "
          f"{sum(losses[-10:]) / 10:.3f} (mean of the last 10)")
    print("sample:", repr(sample(model, "Shall I", 24)))


if __name__ == "__main__":
    main()
