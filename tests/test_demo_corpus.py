"""examples/demo_corpus.py, the corpus and sampling stages of `make demo`: its file list, the
tokens its ingest stores (checked against the files read with plain Python), the unigram
entropy (against numpy on the raw bytes), the Loader it makes, and a checkpoint loaded back
on one process with the very weights that were saved."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sysconfig

import numpy as np
import pytest

import dtm
from dtm.ckpt.errors import CheckpointKeyError
from dtm.models.char_gpt import TrainConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("demo_corpus", ROOT / "examples" / "demo_corpus.py")
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)

FEW = 5  # files ingested by the tests: the first ones of the list, each a few KiB


def raw(files: list[str]) -> list[bytes]:
    out = []
    for path in files:
        with open(path, "rb") as f:
            out.append(f.read())
    return out


@pytest.fixture(scope="module")
def files() -> list[str]:
    return demo.corpus_files()


@pytest.fixture(scope="module")
def ingested(files, tmp_path_factory):
    """The first FEW corpus files ingested by 2 worker processes into a directory store."""
    path = tmp_path_factory.mktemp("store")
    st = dtm.store.open(path)
    m = demo.ingest_corpus(st, "corpus", workers=2, files=files[:FEW], show=False)
    yield st, m
    st.close()


def test_the_file_list_is_deterministic_ascii_library_code_of_the_intended_size(files):
    stdlib = sysconfig.get_paths()["stdlib"]
    assert files == demo.corpus_files()
    sizes = [os.path.getsize(f) for f in files]
    assert demo.CORPUS_BYTES <= sum(sizes) < demo.CORPUS_BYTES + sizes[-1]  # it stops at the first file past it
    rel = [os.path.relpath(f, stdlib) for f in files]
    assert rel == sorted(rel) and all(r.endswith(".py") and not r.startswith("..") for r in rel)
    assert not any(set(pathlib.PurePath(r).parts[:-1]) & demo.SKIP_DIRS for r in rel)
    assert all(data.isascii() for data in raw(files))


def test_ingest_stores_each_files_bytes_as_its_tokens(files, ingested):
    st, m = ingested
    assert [s.source for s in m.shards] == [os.path.abspath(f) for f in files[:FEW]]
    for s, data in zip(m.shards, raw(files[:FEW])):
        tokens = st.get_array(s.key)
        assert tokens.dtype == np.uint8
        np.testing.assert_array_equal(tokens, np.frombuffer(data, np.uint8))
    assert m.elements == sum(map(len, raw(files[:FEW])))


def test_ingest_shows_the_workers_cpu_and_memory(files, tmp_path, capsys):
    st = dtm.store.open(tmp_path / "store")
    demo.ingest_corpus(st, "shown", workers=2, files=files[:2], show=True)
    st.close()
    err = capsys.readouterr().err
    assert "ingest shown: 2/2 files" in err
    assert all(col in err for col in ("worker", "CPU %", "RSS", "w0 ", "w1 "))


def test_unigram_entropy_is_that_of_the_raw_bytes(files, ingested):
    st, _ = ingested
    counts = np.bincount(np.frombuffer(b"".join(raw(files[:FEW])), np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    assert demo.unigram_entropy(st, "corpus") == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)


def test_loader_gives_shifted_int64_windows_and_resumes_from_its_state(ingested):
    st, _ = ingested
    first = demo.loader("corpus", 4, 32, seed=3, store=st)
    x, y = next(first)
    x, y = x.numpy(), y.numpy()
    assert x.dtype == y.dtype == np.int64 and x.shape == y.shape == (4, 32)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    state = first.state_dict()
    want = [a.numpy() for a in next(first)]
    first.close()
    again = demo.loader("corpus", 4, 32, seed=3, store=st)
    again.load_state_dict(state)
    for a, b in zip(next(again), want):
        np.testing.assert_array_equal(a.numpy(), b)
    again.close()


TINY = TrainConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model after one AdamW step, saved with its optimizer, a loader state and the
    step, as the training script saves them: (the model, the checkpoint directory)."""
    dtm.manual_seed(0)
    model = demo.GPT2(demo.model_config(TINY))
    opt = dtm.optim.AdamW(model.parameters(), lr=1e-2)
    ids = dtm.tensor(np.arange(2 * TINY.block_size, dtype=np.int64).reshape(2, -1) % 256)
    model(ids).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("ckpt")
    dtm.checkpoint.save({"model": model, "optim": opt, "loader": {"step": 1, "seed": 0}, "step": 1}, path,
                        step=1).wait()
    return model, path


def test_a_checkpoint_with_an_optimizer_loads_the_very_weights_on_one_process(checkpoint):
    model, path = checkpoint
    loaded = demo.load_model(path, demo.model_config(TINY))
    want = {k: v.numpy() for k, v in model.state_dict().items()}
    have = {k: v.numpy() for k, v in loaded.state_dict().items()}
    assert have.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(have[k], want[k], err_msg=k)


def test_sample_from_checkpoint_decodes_as_the_saved_model_past_its_window(checkpoint):
    model, path = checkpoint
    n = 2 * TINY.block_size + 3  # slides twice
    text = demo.sample_from_checkpoint(path, demo.model_config(TINY), "def ", n, temperature=0)
    model.eval()
    assert text == demo.sample(model, "def ", n, temperature=0)
    assert text.startswith("def ")
    sampled = demo.sample_from_checkpoint(path, demo.model_config(TINY), "def ", 8, temperature=0.8, seed=5)
    assert sampled == demo.sample_from_checkpoint(path, demo.model_config(TINY), "def ", 8, temperature=0.8, seed=5)


def test_a_model_of_another_shape_is_refused_naming_the_keys(checkpoint):
    _, path = checkpoint
    with pytest.raises(CheckpointKeyError) as e:
        demo.load_model(path, demo.model_config(TrainConfig(block_size=16, n_layer=2, n_head=2, n_embd=16)))
    assert any(k.startswith("h.1.") for k in e.value.missing) and not e.value.unexpected
