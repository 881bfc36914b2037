"""A directory store opened with durable=False (spec 9.2.6, what checkpoints use): its puts
read back at once, their files wait for `Store.sync`, which syncs each noted file and
directory once, and a durable store notes nothing."""

from __future__ import annotations

import os

import numpy as np

import dtm


def test_deferred_puts_read_back_and_sync_once(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    x = np.arange(3 * 1000, dtype=np.float32).reshape(3, 1000)
    st = dtm.store.open(tmp_path / "s", inline_bytes=0, durable=False, chunk_bytes=4096)
    synced.clear()
    st.put("a/x", x)
    st.put("b", x[0])
    files = [p for p in synced if "/data/" in p]
    assert files == [], files  # (the index's own commits still sync: sqlite calls fsync itself)
    np.testing.assert_array_equal(st.get_array("a/x"), x)
    st.sync()
    written = {os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "s" / "data") for f in fs}
    done = [p for p in synced if p.startswith(str(tmp_path / "s" / "data"))]
    assert written <= set(done), written - set(done)          # every chunk and zarr.json
    assert len(done) == len(set(done)), "a path was synced twice"
    assert str(tmp_path / "s" / "data") in done                  # and the directories above them
    synced.clear()
    st.sync()
    assert synced == []
    st.close()
    st = dtm.store.open(tmp_path / "s")
    np.testing.assert_array_equal(st.get_array("b"), x[0])
    synced.clear()
    st.put("c", x)
    assert [p for p in synced if "/data/" in p]                # durable: each put syncs its files
    st.close()
