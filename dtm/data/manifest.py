"""The manifest of an ingest: which shards hold what, in input order (spec chapter 10 names
its faults E1305/E1306).

It is stored beside the shards, under `PREFIX/manifest`, as the UTF-8 bytes of a JSON
object in a uint8 tensor: the store keeps tensors only, and JSON is read without running
anything (no pickle). Shards are `PREFIX/shard/RUN/NNNNNN`, one per input file, RUN naming
the ingest that wrote them: a re-ingest writes fresh keys and never overwrites a shard the
current manifest names, so until its own manifest replaces that one the old dataset stays
whole (ingest.py).

    {"format": "dtm.data/1", "prefix": "corpus", "fn": "dtm.data.tokenize:word_tokens",
     "shards": [{"key": "corpus/shard/20250101T120000-9a1f03/000000", "source": "/data/a.txt", "dtype": "uint16",
                 "shape": [1234], "checksum": "9a1f03c2", "read_bytes": 5678}, ...]}
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import ErrorCode as E
from .errors import DataError

FORMAT = "dtm.data/1"
MAX_MANIFEST_BYTES = 256 << 20  # about a million shards; bounded before it is parsed


def manifest_key(prefix: str) -> str:
    return f"{prefix}/manifest"


def shards_prefix(prefix: str) -> str:
    """Where every run's shards of the dataset `prefix` live."""
    return f"{prefix}/shard/"


def new_run() -> str:
    """A fresh run id: a key segment no earlier ingest used (time for the reader, random
    bytes so that two runs in one second differ)."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.urandom(3).hex()}"


def shard_key(prefix: str, run: str, i: int) -> str:
    return f"{shards_prefix(prefix)}{run}/{i:06d}"


@dataclass(frozen=True)
class Shard:
    key: str
    source: str          # the input file it came from
    dtype: str           # DTM dtype name
    shape: tuple[int, ...]
    checksum: str        # the store's checksum of the tensor when it was written
    read_bytes: int      # size of the input file

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Manifest:
    prefix: str
    fn: str
    shards: list[Shard] = field(default_factory=list)

    @property
    def elements(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def read_bytes(self) -> int:
        return sum(s.read_bytes for s in self.shards)

    def to_json(self) -> bytes:
        body = {"format": FORMAT, "prefix": self.prefix, "fn": self.fn, "shards": [asdict(s) for s in self.shards]}
        return json.dumps(body, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "Manifest":
        """Parse and check a manifest (E1306 naming `where` on any fault)."""
        try:
            body = json.loads(data)
            if body.get("format") != FORMAT:
                raise ValueError(f"format {body.get('format')!r}, expected {FORMAT!r}")
            shards = [Shard(str(s["key"]), str(s["source"]), str(s["dtype"]), tuple(int(d) for d in s["shape"]),
                            str(s["checksum"]), int(s["read_bytes"])) for s in body["shards"]]
            return cls(str(body["prefix"]), str(body["fn"]), shards)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(E.DATA_MANIFEST_INVALID, f"{where}: not an ingest manifest: {e}") from None


def save(store, m: Manifest) -> None:
    """Write `m` under PREFIX/manifest (one atomic put: readers see the old one or this)."""
    store.put_array(manifest_key(m.prefix), np.frombuffer(m.to_json(), np.uint8))


def load(store, prefix: str) -> Manifest:
    """The manifest under `prefix`: E1305 when there is none, E1306 when it is not one."""
    from ..store import InvalidKey, KeyMissing

    key = manifest_key(prefix.rstrip("/"))
    where = f"{store.url} {key!r}" if hasattr(store, "url") else repr(key)
    try:
        info = store.info(key)
    except (KeyMissing, InvalidKey) as e:
        raise DataError(E.DATA_MANIFEST_MISSING, f"{where}: no ingest manifest under the prefix {prefix!r} (write "
                                                 f"one with dtm.data.ingest): {e.message}") from None
    if str(info.dtype) != "u8" or len(info.shape) != 1 or info.nbytes > MAX_MANIFEST_BYTES:
        raise DataError(E.DATA_MANIFEST_INVALID, f"{where}: holds {info.dtype}{list(info.shape)}, not a manifest's "
                                                 f"uint8 JSON of at most {MAX_MANIFEST_BYTES} bytes")
    return Manifest.from_json(store.get_array(key).tobytes(), where)
