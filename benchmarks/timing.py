"""Timing helpers shared by the benchmarks (each benchmark runs as a script from this folder)."""

from __future__ import annotations

import time
from typing import Callable


def best_time(fn: Callable[[], object], budget: float = 1.0, runs: int = 5) -> float:
    """Seconds per call of `fn`: the best of `runs` batches, each about budget/runs long
    (after one warm-up call), so quick calls are timed over many repetitions."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    reps = max(1, int(budget / runs / max(once, 1e-6)))
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def best_of(fn: Callable[[], object], runs: int) -> float:
    """The shortest of `runs` timed calls of `fn`, in seconds (for calls long enough to time once)."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
