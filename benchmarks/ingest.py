"""Parallel ingest against multiprocessing.Pool, in one run (issue 18).

A corpus of `--mb` MB of text (the standard library's own .py sources, concatenated in
sorted order and repeated until the size is reached, cut into `--file-mb` files: the same
bytes on every machine with the same Python) is tokenized with dtm.data.tokenize.word_tokens
(regex words, each hashed into 50,257 ids: Python work per token, as a BPE tokenizer costs)
and every file's tokens are put into a directory store:

- dtm: `dtm.data.ingest(files, word_tokens, prefix, workers=N)`, N = 1 and 2: worker
  processes (forks of the fork server) fed file names over pipes, shards written by the
  workers, the manifest by the parent; the timing includes starting the workers.
- pool: `multiprocessing.Pool(N).map` (fork) of a function that reads a file, tokenizes it
  and puts the tokens into the same store: the same work, with Python's own pool.

Figures: MB/s of input text, the 2-worker speedup of each, and dtm / pool time ratios
(above 1.0, DTM is faster). The corpus and the store live in /dev/shm where it exists, so
the disk does not set the pace. The load average is printed: on a shared machine the
speedup says as much about the neighbours as about the code.

    python benchmarks/ingest.py              # 32 MB, a quick run
    python benchmarks/ingest.py --mb 300     # the README's figures
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import shutil
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtm  # noqa: E402
from dtm.data import ingest  # noqa: E402
from dtm.data.tokenize import word_tokens  # noqa: E402


def make_corpus(root: str, mb: int, file_mb: float) -> list[str]:
    sources = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    text = b"".join(open(p, "rb").read() for p in sources)
    total, per_file = mb * 1_000_000, int(file_mb * 1_000_000)
    files, pos, written = [], 0, 0
    while written < total:
        n = min(per_file, total - written)
        chunk = bytearray()
        while len(chunk) < n:
            take = text[pos:pos + n - len(chunk)]
            chunk += take
            pos = (pos + len(take)) % len(text)
        path = os.path.join(root, f"part{len(files):05d}.txt")
        with open(path, "wb") as f:
            f.write(chunk)
        files.append(path)
        written += n
    return files


_pool_store = None


def _pool_task(args: tuple[str, str, str]) -> int:
    global _pool_store
    path, url, key = args
    if _pool_store is None:
        _pool_store = dtm.store.open(url)
    with open(path, "rb") as f:
        data = f.read()
    _pool_store.put_array(key, word_tokens(data))
    return len(data)


def run_pool(files: list[str], url: str, workers: int) -> None:
    with mp.get_context("fork").Pool(workers) as pool:
        pool.map(_pool_task, [(p, url, f"pool{workers}/shard/{i:06d}") for i, p in enumerate(files)], chunksize=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=32, help="corpus size in MB")
    ap.add_argument("--file-mb", type=float, default=4.0, help="size of each corpus file in MB")
    args = ap.parse_args()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="dtm-ingest-bench-", dir=base)
    try:
        os.makedirs(os.path.join(root, "corpus"))
        files = make_corpus(os.path.join(root, "corpus"), args.mb, args.file_mb)
        mb = sum(os.path.getsize(p) for p in files) / 1e6
        url = os.path.join(root, "store")
        st = dtm.store.open(url)
        print(f"corpus: {mb:.0f} MB in {len(files)} files; {os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.2f} before the runs")
        seconds: dict[tuple[str, int], float] = {}
        for workers in (1, 2):
            start = time.perf_counter()
            ingest(files, word_tokens, f"dtm{workers}", workers=workers, store=st)
            seconds["dtm", workers] = time.perf_counter() - start
            start = time.perf_counter()
            run_pool(files, url, workers)
            seconds["pool", workers] = time.perf_counter() - start
        print(f"{'':6} {'1 worker':>12} {'2 workers':>12} {'speedup':>8}")
        for who in ("dtm", "pool"):
            one, two = seconds[who, 1], seconds[who, 2]
            print(f"{who:6} {mb / one:8.1f} MB/s {mb / two:7.1f} MB/s {one / two:7.2f}x")
        print(f"dtm / pool (pool time / dtm time): 1 worker {seconds['pool', 1] / seconds['dtm', 1]:.2f}, "
              f"2 workers {seconds['pool', 2] / seconds['dtm', 2]:.2f}; load average after {os.getloadavg()[0]:.2f}")
        st.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
