"""The corpus and sampling stages of `make demo`: a real text corpus ingested into the tensor
store by parallel worker processes, a Loader over it, and text sampled from a checkpoint.

    files = corpus_files()                          # ~3 MB of the standard library's .py sources
    m = ingest_corpus(st, "corpus", workers=2)      # token shards + manifest, workers' CPU/RSS shown
    h = unigram_entropy(st, "corpus")               # nats per token: the loss to beat by far
    for x, y in loader("corpus", batch=16, block=128, seed=0, store=st): ...
    print(sample_from_checkpoint("runs/demo", model_config(DEMO), "def ", 200))

The corpus is Python's own library (`sysconfig.get_paths()["stdlib"]`), so it exists on any
fresh machine with no download. Tokens are bytes (`dtm.data.tokenize.byte_tokens`, vocabulary
256): the tokens are the files' bytes exactly (a test checks them against the files), nothing
has to be fitted or shipped, and the worker processes import the tokenizer by name. A
printable-ASCII vocabulary (~100 ids) would save only the embedding rows and logits of the
~160 byte values the corpus never uses; the model learns those away within its first steps,
and the output projection is a small part of the step at this model size.

Run alone (`python examples/demo_corpus.py`), it does stages 1 and 5 on one process, with a
plain single-process training between them (`--ingest DIR`: stage 1 alone, the first step
of the cluster jobs in examples/cluster/): ingest, train `DEMO` from the Loader, save a
checkpoint, load it into a fresh model and sample. `DEMO` is the configuration the
distributed demo trains too.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable

import numpy as np

import dtm
from dtm.ckpt.errors import CheckpointKeyError
from dtm.data import Loader, Manifest, Progress, Shard, load_manifest
from dtm.data.manifest import save as save_manifest
from dtm.data.tokenize import byte_tokens
from dtm.models.char_gpt import TrainConfig
from dtm.models.gpt2 import GPT2, GPT2Config
from dtm.nn import functional as NF

CORPUS_BYTES = 3_000_000   # enough text that ~1 minute of training never repeats a window much
VOCAB = 256                # byte tokens
# Test suites are mostly asserts and fixtures, pydoc_data is English prose, site-packages is
# not Python's own: keeping them out leaves the library's ordinary code.
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "pydoc_data", "site-packages", "__pycache__"})

# The model and training of the demo (single-process here, DP=2 x TP=2 in the distributed
# stage), measured on 2 cores at ~40 ms a step: 1000 steps bring the loss from 5.4 to ~1.7
# nats, about 55% of the corpus's unigram entropy (3.12). Of the same tokens per step, 32
# windows of 64 learned faster than 16 of 128 (1.67 against 2.00 at step 1000); lr 6e-3
# and 1e-2 stayed longer on the unigram plateau (~2.9) than 3e-3.
DEMO = TrainConfig(steps=1000, batch_size=32, block_size=64, n_layer=2, n_head=4, n_embd=128, lr=3e-3, seed=0)


def corpus_files(target_bytes: int = CORPUS_BYTES) -> list[str]:
    """The standard library's .py files, in sorted order of their paths under the stdlib
    directory, from the first on until they hold `target_bytes` bytes. Test suites and
    non-Python text are left out (SKIP_DIRS), and so is every file with a non-ASCII byte, so
    that any window of the corpus decodes as text. The same Python gives the same list."""
    root = sysconfig.get_paths()["stdlib"]
    candidates = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS]
        candidates += [os.path.join(d, n) for n in names if n.endswith(".py")]
    out, total = [], 0
    for path in sorted(candidates, key=lambda p: os.path.relpath(p, root)):
        if total >= target_bytes:
            break
        with open(path, "rb") as f:
            data = f.read()
        if data.isascii():
            out.append(path)
            total += len(data)
    return out


def _open(store):
    """A Store from a Store, a path or URL; None: the current store (the mesh's after dtm.init())."""
    if store is None:
        return dtm.store.current()
    return dtm.store.open(store) if isinstance(store, (str, os.PathLike)) else store


class _ProgressTable:
    """The live table `dtm ingest` shows: files, bytes, MB/s, and each worker's CPU and RSS."""

    def __init__(self, prefix: str):
        from dtm.cluster.top import live_view, table_console

        self.prefix = prefix
        self.prev = None
        self._view = live_view(table_console(stderr=True))

    def __enter__(self) -> "_ProgressTable":
        self.live = self._view.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._view.__exit__(*exc)

    def __call__(self, p: Progress) -> None:
        from rich.console import Group
        from rich.text import Text

        from dtm.cluster.top import Snapshot, human_bytes, table

        snap = Snapshot(time.monotonic(), {r.name: r for r in p.workers})
        rate = p.read_bytes / max(p.elapsed_s, 1e-9) / 1e6
        head = Text(f"ingest {self.prefix}: {p.files_done}/{p.files_total} files, {human_bytes(p.read_bytes)} read, "
                    f"{rate:.1f} MB/s, {p.elapsed_s:.0f} s")
        self.live.update(Group(head, table(snap, self.prev, ops_name="files", key_name="worker")), refresh=True)
        self.prev = snap


def ingest_corpus(store, prefix: str, workers: int = 2, files: list[str] | None = None,
                  show: bool = True) -> Manifest:
    """Ingest `files` (default: corpus_files()) as byte tokens under `prefix` of `store` (a
    Store, a path or URL, None for the current store) with `workers` worker processes,
    showing `dtm ingest`'s table of their CPU and memory when `show`; the manifest.

    On the mesh's store (after dtm.init(); call it on ONE rank, then barrier) the workers
    cannot write to it: a worker opens its store by URL, and the mesh's store is a service
    of the ranks, not a URL. The workers then ingest into a scratch directory store and the
    shards are put into the mesh's store under the same keys, with a manifest of the
    checksums the mesh's store gave them (what the Loader checks)."""
    st = _open(store)
    files = corpus_files() if files is None else files
    if not (isinstance(st, dtm.store.MeshStore) and workers):
        return _ingest(files, st, prefix, workers, show)
    with tempfile.TemporaryDirectory(prefix="dtm-corpus-") as tmp:
        scratch = dtm.store.open(tmp)
        try:
            m = _ingest(files, scratch, prefix, workers, show)
            shards = [Shard(s.key, s.source, s.dtype, s.shape, st.put_array(s.key, scratch.get_array(s.key)).checksum,
                            s.read_bytes) for s in m.shards]
        finally:
            scratch.close()
    published = Manifest(m.prefix, m.fn, shards)
    save_manifest(st, published)
    return published


def _ingest(files: list[str], st, prefix: str, workers: int, show: bool) -> Manifest:
    if not show:
        return dtm.data.ingest(files, byte_tokens, prefix, workers=workers, store=st)
    with _ProgressTable(prefix) as table:
        return dtm.data.ingest(files, byte_tokens, prefix, workers=workers, store=st, progress=table)


def token_counts(store, prefix: str) -> np.ndarray:
    """How often each of the VOCAB token ids occurs in the dataset under `prefix`."""
    st = _open(store)
    counts = np.zeros(VOCAB, np.int64)
    for s in load_manifest(st, prefix).shards:
        counts += np.bincount(st.get_array(s.key), minlength=VOCAB)
    return counts


def unigram_entropy(store, prefix: str) -> float:
    """The entropy of the dataset's token frequencies, in nats per token: the loss of the
    best model that ignores context, which a trained model's loss must be well under."""
    counts = token_counts(store, prefix)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def loader(prefix: str, batch: int, block: int, seed: int, store=None, start: int = 0) -> Loader:
    """The dtm.data Loader over `prefix`: global batches (x, y) of int64 ids [batch, block],
    y being x shifted by one, shuffled per epoch by `seed`. Every rank of a mesh that makes
    it alike gets the same batches (DDP then splits them); its `state_dict()` goes into a
    checkpoint's state, and `load_state_dict` (or `start`) resumes at the next batch."""
    return Loader(store, prefix, batch, block, shuffle=True, seed=seed, start=start)


def model_config(cfg: TrainConfig = DEMO) -> GPT2Config:
    """The byte-level GPT-2 of `cfg`."""
    return GPT2Config(vocab_size=VOCAB, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                      n_head=cfg.n_head)


def load_model(ckpt_dir: str | os.PathLike, config: GPT2Config, step: int | None = None) -> GPT2:
    """A GPT-2 of `config` on this process (no mesh) with the weights of the state "model" of
    checkpoint `step` (None: the newest) under `ckpt_dir`, saved on one process or laid out
    over a mesh (load reads it whole here). The checkpoint may hold more (an optimizer, a
    loader, the step): those are not read. The model's keys must be exactly the saved
    ones (CheckpointKeyError else): strict=False, needed to leave the rest out, would also
    let a wrong model keep random weights."""
    model = GPT2(config, init=False)
    saved = dtm.checkpoint.read_manifest(ckpt_dir, step)["state"].get("model", {})
    keys = {str(k) for k, _ in saved.get("tree", {}).get("dict", [])}
    have = set(model.state_dict())
    if keys != have:
        raise CheckpointKeyError(sorted(have - keys), sorted(keys - have), os.fspath(ckpt_dir))
    dtm.checkpoint.load({"model": model}, ckpt_dir, step, strict=False)
    model.eval()
    return model


def decode(ids) -> str:
    """Byte tokens as text (a byte that does not decode, which the ASCII corpus does not
    have but a sampled sequence may, shows as U+FFFD)."""
    return bytes(np.asarray(ids, np.int64).astype(np.uint8).tolist()).decode("utf-8", errors="replace")


def sample(model: GPT2, prompt: str, n: int, temperature: float = 0.8, top_k: int | None = 20,
           seed: int = 0) -> str:
    """`prompt` followed by `n` sampled tokens (greedy when `temperature` is 0). Past the
    model's window it slides: each call keeps the last half window as context and
    generates the other half."""
    ids = np.frombuffer(prompt.encode("utf-8"), np.uint8).astype(np.int64)[None]
    window = model.config.n_positions
    rng = np.random.default_rng(seed)
    new: list[np.ndarray] = []
    made = 0
    while made < n:
        context = np.concatenate([ids] + new, axis=1)[:, -(window // 2):]
        k = min(n - made, window - context.shape[1])
        out = model.generate(context, k, do_sample=temperature > 0, temperature=temperature or 1.0,
                             top_k=top_k if temperature > 0 else None, generator=rng)
        new.append(out.numpy()[:, context.shape[1]:])
        made += k
    return prompt + decode(np.concatenate(new, axis=1)[0])


def sample_from_checkpoint(ckpt_dir: str | os.PathLike, config: GPT2Config, prompt: str, n: int,
                           temperature: float = 0.8, seed: int = 0) -> str:
    """Build the GPT-2 of `config` on this one process, load the checkpoint's "model" into
    it (load_model) and sample `n` tokens after `prompt` (sample)."""
    return sample(load_model(ckpt_dir, config), prompt, n, temperature=temperature, seed=seed)


# --- stages 1 and 5 on one process ---------------------------------------------------------------

def train(cfg: TrainConfig, batches: Loader, say: Callable[[str], None]) -> tuple[GPT2, list[float]]:
    """char_gpt.train's loop (AdamW, cosine schedule) over the Loader's batches, the whole
    step one dtm.jit program as the distributed demo runs it."""
    dtm.manual_seed(cfg.seed)
    model = GPT2(model_config(cfg))
    model.train()
    opt = dtm.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = dtm.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps, eta_min=cfg.lr / 10)

    @dtm.jit
    def train_step(x, y):
        loss = NF.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses: list[float] = []
    t0 = time.perf_counter()
    for step, (x, y) in zip(range(cfg.steps), batches):
        losses.append(train_step(x, y).item())
        sched.step()
        if step % 20 == 0 or step == cfg.steps - 1:
            rate = (step + 1) * cfg.batch_size * cfg.block_size / (time.perf_counter() - t0)
            say(f"step {step:4d}  loss {losses[-1]:.4f}  {rate:7,.0f} tokens/s  {time.perf_counter() - t0:5.1f} s")
    return model, losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=DEMO.steps)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None, help="directory for the store and the checkpoint (default: a temporary one)")
    ap.add_argument("--ingest", default=None, metavar="DIR",
                    help="only ingest the corpus into DIR/store and exit (a cluster job's first step)")
    args = ap.parse_args()
    if args.ingest:
        st = dtm.store.open(os.path.join(args.ingest, "store"))
        m = ingest_corpus(st, "corpus", workers=args.workers)
        print(f"ingested {len(m.shards)} files into {args.ingest}/store; unigram entropy "
              f"{unigram_entropy(st, 'corpus'):.3f} nats/token", flush=True)
        st.close()
        return 0
    cfg = TrainConfig(**{**DEMO.__dict__, "steps": args.steps})
    say = lambda s: print(s, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="dtm-demo-") as tmp:
        out = args.out or tmp
        st = dtm.store.open(os.path.join(out, "store"))
        t0 = time.perf_counter()
        files = corpus_files()
        m = ingest_corpus(st, "corpus", workers=args.workers, files=files)
        took = time.perf_counter() - t0
        entropy = unigram_entropy(st, "corpus")
        say(f"stage 1: {len(files)} files, {m.elements:,} byte tokens ingested with {args.workers} workers in "
            f"{took:.1f} s; unigram entropy {entropy:.3f} nats/token")

        say(f"training {cfg.steps} steps on one process: {cfg.n_layer} layers, {cfg.n_embd} wide, {cfg.n_head} "
            f"heads, block {cfg.block_size}, batch {cfg.batch_size}, lr {cfg.lr:g}")
        batches = loader("corpus", cfg.batch_size, cfg.block_size, cfg.seed, store=st)
        t1 = time.perf_counter()
        model, losses = train(cfg, batches, say)
        trained = time.perf_counter() - t1
        ckpt = os.path.join(out, "ckpt")
        dtm.checkpoint.save({"model": model, "loader": batches.state_dict(), "step": cfg.steps}, ckpt,
                            step=cfg.steps).wait()
        batches.close()

        t2 = time.perf_counter()
        text = sample_from_checkpoint(ckpt, model_config(cfg), "def ", 300)
        sampled = time.perf_counter() - t2
        final = float(np.mean(losses[-10:]))
        say(f"stage 5: sampled from {ckpt} on one process in {sampled:.1f} s:\n{'-' * 60}\n{text}\n{'-' * 60}")
        say(f"summary: ingest {took:.1f} s, training {trained:.1f} s, loss {losses[0]:.3f} -> {final:.3f} (mean of "
            f"the last 10) vs unigram entropy {entropy:.3f} nats/token ({final / entropy:.0%} of it)")
        st.close()
        return 0 if final < entropy else 1


if __name__ == "__main__":
    sys.exit(main())
