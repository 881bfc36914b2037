"""dtm.data.ingest and dtm.data.Loader (issue 18): shards and manifest, worker faults, and
batches that repeat across fresh loaders and processes."""

import hashlib
import logging
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import dtm
from dtm.data import DataError, IngestError, Loader, ingest, load_manifest, tokenize
from dtm.errors import ErrorCode as E


# --- ingest functions, importable by name in worker processes ---------------------------------

def ints(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8).astype(np.uint16) * 3


def fail_on_bad(data: bytes) -> np.ndarray:
    if data.startswith(b"bad"):
        raise ValueError("cannot tokenize this")
    return ints(data)


def die_once(data: bytes) -> np.ndarray:
    """SIGKILLs its own worker the first time it sees a `die:MARKER` file."""
    if data.startswith(b"die:"):
        marker = data[4:].decode().strip()
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    return ints(data)


def die_always(data: bytes) -> np.ndarray:
    if data.startswith(b"die"):
        os.kill(os.getpid(), signal.SIGKILL)
    return ints(data)


def not_an_array(data: bytes) -> str:
    return "tokens"


def logged_slow_ints(data: bytes) -> np.ndarray:
    """`ints`, slowly, after a line in the file $INGEST_LOG: a file is about to be stored."""
    with open(os.environ["INGEST_LOG"], "a") as f:
        f.write("x\n")
    time.sleep(0.2)
    return ints(data)


@pytest.fixture
def corpus(tmp_path):
    files = []
    for i in range(5):
        p = tmp_path / f"doc{i}.txt"
        p.write_bytes(bytes((i * 7 + k) % 251 for k in range(300 + 50 * i)))
        files.append(str(p))
    return files


@pytest.fixture
def store_dir(tmp_path):
    return str(tmp_path / "store")


def test_parallel_ingest_matches_inline_and_stores_a_manifest(corpus, store_dir):
    st = dtm.store.open(store_dir)
    m = ingest(corpus, ints, "par", workers=2, store=st)
    inline = ingest(corpus, ints, "one", workers=0, store=st)
    assert [s.source for s in m.shards] == corpus  # input order, whichever worker did which file
    assert m.fn == f"{__name__}:ints" and m.elements == sum(os.path.getsize(f) for f in corpus)
    for a, b, f in zip(m.shards, inline.shards, corpus):
        want = ints(open(f, "rb").read())
        assert np.array_equal(st.get_array(a.key), want) and np.array_equal(st.get_array(b.key), want)
    assert load_manifest(st, "par") == m
    # a shorter ingest into the same prefix leaves no stale shards behind
    short = ingest(corpus[:2], ints, "par", workers=0, store=st)
    assert st.keys("par/shard/") == [s.key for s in short.shards]


def _lines(path) -> int:
    try:
        with open(path) as f:
            return len(f.readlines())
    except FileNotFoundError:
        return 0


def _kill_reingest_midway(files, store_dir, log, workers: int) -> None:
    """Re-ingest `files` into "ds" in another process (and its workers); SIGKILL them all
    at a random moment once at least one file is stored (2 workers each log a file before
    storing it, so 3 lines mean one stored) and before the last is."""
    code = (f"import importlib, dtm\nfn = importlib.import_module({__name__!r}).logged_slow_ints\n"
            f"dtm.data.ingest({files!r}, fn, 'ds', workers={workers}, store={store_dir!r})\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), INGEST_LOG=str(log))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    try:
        at, deadline = random.randint(3, len(files) - 2), time.monotonic() + 60
        while _lines(log) < at and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "the re-ingest ended before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reingest_killed_midway_leaves_the_old_dataset_whole(tmp_path, store_dir, workers):
    old_files, new_files = [], []
    for i in range(8):
        for name, files, salt in (("old", old_files, 1), ("new", new_files, 5)):
            p = tmp_path / f"{name}{i}.txt"
            p.write_bytes(bytes((i * salt + k) % 251 for k in range(200 + 20 * i)))
            files.append(str(p))
    st = dtm.store.open(store_dir)
    old = ingest(old_files, ints, "ds", workers=0, store=st)
    before = _digest(_take(Loader(st, "ds", 2, 16, seed=1, numpy=True), 10))
    _kill_reingest_midway(new_files, store_dir, tmp_path / "log", workers)

    st = dtm.store.open(store_dir)
    assert load_manifest(st, "ds") == old
    for s, f in zip(old.shards, old_files):
        assert np.array_equal(st.get_array(s.key), ints(open(f, "rb").read()))
    opened_on_old = Loader(st, "ds", 2, 16, seed=1, numpy=True)
    assert _digest(_take(Loader(st, "ds", 2, 16, seed=1, numpy=True), 10)) == before

    new = ingest(new_files, ints, "ds", workers=2, store=st)
    for s, f in zip(new.shards, new_files):
        assert np.array_equal(st.get_array(s.key), ints(open(f, "rb").read()))
    assert set(st.keys("ds/shard/")) == {s.key for s in new.shards}  # the old run's and the killed run's: gone
    assert _digest(_take(opened_on_old, 10)) == before  # a loader opened before the switch keeps its data


def test_a_lambda_or_nested_function_is_refused_before_any_work(corpus, store_dir):
    with pytest.raises(DataError) as e:
        ingest(corpus, lambda b: ints(b), "x", workers=1, store=store_dir)
    assert e.value.code is E.INGEST_FN_NOT_IMPORTABLE and "lambda" in e.value.message

    def local(b):
        return ints(b)
    with pytest.raises(DataError) as e:
        ingest(corpus, local, "x", workers=1, store=store_dir)
    assert e.value.code is E.INGEST_FN_NOT_IMPORTABLE


def test_missing_file_is_refused_naming_it(corpus, store_dir, tmp_path):
    gone = str(tmp_path / "nope.txt")
    with pytest.raises(IngestError) as e:
        ingest(corpus + [gone], ints, "x", workers=1, store=store_dir)
    assert e.value.code is E.INGEST_INPUT_MISSING and gone in e.value.message
    assert "x/manifest" not in dtm.store.open(store_dir)


def test_fn_raising_names_the_file_and_worker(corpus, store_dir, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"bad input")
    with pytest.raises(IngestError) as e:
        ingest(corpus[:1] + [str(bad)], fail_on_bad, "x", workers=1, store=store_dir)
    assert e.value.code is E.INGEST_FN_FAILED
    assert str(bad) in e.value.message and "worker pid" in e.value.message and "cannot tokenize" in e.value.message
    with pytest.raises(IngestError) as e:
        ingest(corpus[:1], not_an_array, "x", workers=0, store=store_dir)
    assert e.value.code is E.INGEST_FN_FAILED and "numeric array" in e.value.message


def test_a_worker_killed_mid_file_is_replaced_and_the_file_retried(corpus, store_dir, tmp_path, caplog):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(f"die:{tmp_path / 'marker'}".encode())
    with caplog.at_level(logging.WARNING, logger="dtm.data"):
        m = ingest(corpus[:2] + [str(victim)], die_once, "k", workers=1, store=store_dir)
    assert "SIGKILL" in caplog.text and str(victim) in caplog.text
    st = dtm.store.open(store_dir)
    assert np.array_equal(st.get_array(m.shards[2].key), ints(victim.read_bytes()))


def test_a_file_that_kills_every_worker_is_reported(corpus, store_dir, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"die")
    with pytest.raises(IngestError) as e:
        ingest([str(victim)], die_always, "k", workers=1, store=store_dir, retries=1)
    assert e.value.code is E.INGEST_WORKER_LOST and e.value.path == str(victim)
    assert "SIGKILL" in e.value.message and "2 time(s)" in e.value.message


def test_memory_store_needs_workers_0(corpus):
    with pytest.raises(DataError) as e:
        ingest(corpus, ints, "x", workers=2, store="memory://ingest-test")
    assert "workers=0" in e.value.message
    m = ingest(corpus, ints, "x", workers=0, store="memory://ingest-test")
    assert len(m.shards) == 5


# --- the loader -------------------------------------------------------------------------------

@pytest.fixture
def tokens_store(tmp_path):
    st = dtm.store.open(tmp_path / "tok")
    docs = []
    for i in range(4):
        p = tmp_path / f"t{i}.txt"
        p.write_bytes(("word%d and more words. " % i * (40 + 10 * i)).encode())
        docs.append(str(p))
    ingest(docs, tokenize.byte_tokens, "tok", workers=0, store=st)
    return st


def _digest(batches) -> str:
    h = hashlib.sha256()
    for x, y in batches:
        h.update(np.ascontiguousarray(x).tobytes() + np.ascontiguousarray(y).tobytes())
    return h.hexdigest()


def _take(loader, n):
    out = [next(loader) for _ in range(n)]
    loader.close()
    return out


def test_loader_batches_are_windows_shifted_by_one_and_tensors_by_default(tokens_store):
    x, y = next(Loader(tokens_store, "tok", 4, 16, seed=1))
    assert isinstance(x, dtm.Tensor) and tuple(x.shape) == (4, 16) and x.dtype == dtm.int64
    xn, yn = x.numpy(), y.numpy()
    assert np.array_equal(xn[:, 1:], yn[:, :-1])


def test_loader_repeats_across_fresh_loaders_restarts_and_processes(tokens_store):
    first = _take(Loader(tokens_store, "tok", 3, 8, seed=7, numpy=True), 40)  # several epochs
    assert _digest(first) == _digest(_take(Loader(tokens_store, "tok", 3, 8, seed=7, numpy=True), 40))
    assert _digest(first[25:]) == _digest(_take(Loader(tokens_store, "tok", 3, 8, seed=7, start=25, numpy=True), 15))
    assert _digest(first) != _digest(_take(Loader(tokens_store, "tok", 3, 8, seed=8, numpy=True), 40))
    code = ("import sys, hashlib, numpy as np, dtm\n"
            "L = dtm.data.Loader(sys.argv[1], 'tok', 3, 8, seed=7, numpy=True)\n"
            "h = hashlib.sha256()\n"
            "for _ in range(40):\n"
            "    x, y = next(L); h.update(np.ascontiguousarray(x).tobytes() + np.ascontiguousarray(y).tobytes())\n"
            "print(h.hexdigest())\n")
    out = subprocess.run([sys.executable, "-c", code, tokens_store.url.removeprefix("file://")], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _digest(first)


def test_shuffled_epoch_visits_every_window_once(tokens_store):
    L = Loader(tokens_store, "tok", 1, 8, seed=3, numpy=True)
    seen = {tuple(L.batch(i)[0][0]) for i in range(L.windows)}
    plain = {tuple(Loader(tokens_store, "tok", 1, 8, shuffle=False, numpy=True).batch(i)[0][0])
             for i in range(L.windows)}
    assert seen == plain and len(L._perms) == 1


def test_loader_faults(tokens_store):
    with pytest.raises(DataError) as e:
        Loader(tokens_store, "nothing/here", 2, 8)
    assert e.value.code is E.DATA_MANIFEST_MISSING and "nothing/here" in e.value.message
    with pytest.raises(DataError) as e:
        Loader(tokens_store, "tok", 10_000, 64)
    assert e.value.code is E.DATA_TOO_SMALL
    tokens_store.put_array(load_manifest(tokens_store, "tok").shards[1].key, np.zeros(5, np.uint8))
    with pytest.raises(DataError) as e:
        Loader(tokens_store, "tok", 2, 8)
    assert e.value.code is E.DATA_MANIFEST_INVALID and "replaced" in e.value.message
    tokens_store.put_array("bad/manifest", np.frombuffer(b"{not json", np.uint8))
    with pytest.raises(DataError) as e:
        Loader(tokens_store, "bad", 2, 8)
    assert e.value.code is E.DATA_MANIFEST_INVALID


def test_dtm_ingest_piped_keeps_every_column_and_ends_the_table_with_a_newline(corpus, store_dir):
    out = subprocess.run([sys.executable, "-m", "dtm.cli", "ingest", *corpus, "--prefix", "p", "--store", store_dir,
                          "--fn", f"{__name__}:ints", "-j", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stdout
    header = next(line for line in out.stdout.splitlines() if "worker" in line)
    for col in ("worker", "CPU %", "RSS", "files", "files/s", "sent", "recv", "MB/s", "state", "heard", "last op"):
        assert f" {col} " in header, header  # no column cut to "wor…" at rich's 80 columns for a pipe
    assert any(line.startswith("5 shard(s)") for line in out.stdout.splitlines()), out.stdout
