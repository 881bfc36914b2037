"""Data ingest and loading (L2, issue 18).

- `ingest(paths, fn, out_prefix, workers=N, store=...)`: files -> token shards in the store,
  in parallel worker processes, and a manifest (ingest.py, worker.py, pool.py, manifest.py);
- `Loader(store, prefix, batch_size, block_size, shuffle=, seed=)`: repeatable batches of
  token windows, prefetched in the background (loader.py);
- `tokenize`: tokenizers that need no vocabulary file.

Layer: row 8 of docs/architecture.md's table. It imports `dtm/store`, `dtm/cluster` (activity, the
`dtm top` row type) and `dtm/errors`, never the user-facing API of row 9: the Loader's
batches become `dtm.Tensor`s through a factory that `dtm/__init__.py` installs.
"""

from . import tokenize
from .errors import DataError, IngestError
from .ingest import Progress, ingest
from .loader import Loader, set_tensor_factory
from .manifest import Manifest, Shard, load as load_manifest

__all__ = ["ingest", "Loader", "Manifest", "Shard", "Progress", "load_manifest", "DataError", "IngestError",
           "tokenize", "set_tensor_factory"]
