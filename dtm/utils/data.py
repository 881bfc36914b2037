"""`dtm.utils.data`, as torch.utils.data: Dataset, TensorDataset, DataLoader, default_collate.

    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=1, num_workers=2)
    for xb, yb in loader:   # dtm Tensors, [32, ...] each
        ...

Batches are leaf Tensors over numpy data: `default_collate` stacks in numpy (realizing an
item that is still a pending computation), so a batch is an input a `dtm.jit` step takes,
not a program recorded once per batch.

With `num_workers > 0` the loader starts that many processes (fork where the platform has
it, as torch does on Linux; `multiprocessing_context="spawn"` needs a picklable dataset,
and a dtm Tensor is not one). Batch k goes to worker k % num_workers, which fetches and
collates it and sends it back over its own pipe with its Tensors as numpy arrays; the
loader yields the batches in order, keeping `prefetch_factor` of them asked for per worker.
The pipes carry multiprocessing's pickles, as torch's do: acceptable only because both
ends are processes this loader started on this machine (docs/architecture.md's rule forbids it for
anything from a peer). Every wait is bounded by `timeout`; a worker that dies or stays
silent ends the loop with a DTMError naming it.

A `dtm.data.Loader` (token windows from the tensor store) may be given as the dataset:
each pass of the DataLoader then yields the next epoch's worth of the Loader's own batches
(its batch size, order and prefetching thread).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..data import Loader
from ..errors import DTMError, ErrorCode
from ..tensor import Generator, Tensor, error
from ..tensor.creation import GENERATOR

WAIT_S = 120.0  # the longest the loader waits for one batch from a worker, unless `timeout` says otherwise
IDLE_CHECK_S = 5.0  # how often an idle worker checks that the loader's process still lives
STOP_S = 5.0  # how long a worker may take to exit when told to, before it is terminated


class Dataset:
    """A map-style dataset: `dataset[i]` is item i of `len(dataset)`."""

    def __getitem__(self, index: int) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class TensorDataset(Dataset):
    """Item i is `(t[i] for t in tensors)`: tensors of one first dimension, read once into
    numpy (items are leaves over their rows, not an indexing op each)."""

    def __init__(self, *tensors: Tensor):
        if not tensors or any(len(t) != len(tensors[0]) for t in tensors):
            raise error(ErrorCode.SHAPE_MISMATCH, "TensorDataset: the tensors must share their first dimension, "
                        f"found {[tuple(t.shape) for t in tensors]}")
        self.tensors = tensors
        self._arrays = [t.numpy() for t in tensors]

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        return tuple(Tensor.from_numpy(np.asarray(a[index])) for a in self._arrays)

    def __len__(self) -> int:
        return len(self._arrays[0])


def default_collate(batch: list) -> Any:
    """torch's default_collate: Tensors and numpy arrays stacked into one Tensor, numbers
    into a 1-D one (float64 for floats, int64 for ints, bool for bools), strings kept as a
    list, and mappings, named tuples and sequences collated field by field (a tuple's
    fields come back as a list, as in torch)."""
    elem = batch[0]
    if isinstance(elem, (Tensor, np.ndarray, np.generic)):
        arrays = [e.numpy() if isinstance(e, Tensor) else np.asarray(e) for e in batch]
        if arrays[0].dtype.kind in "OSUV":
            raise error(ErrorCode.ATTRIBUTE_TYPE, f"default_collate: cannot stack arrays of dtype {arrays[0].dtype}")
        return Tensor.from_numpy(np.stack(arrays))
    if isinstance(elem, (bool, int, float)):
        dtype = np.bool_ if isinstance(elem, bool) else np.int64 if isinstance(elem, int) else np.float64
        return Tensor.from_numpy(np.array(batch, dtype=dtype))
    if isinstance(elem, (str, bytes)):
        return batch
    if isinstance(elem, Mapping):
        collated = {key: default_collate([d[key] for d in batch]) for key in elem}
        return _same_type(elem, collated)
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # a named tuple
        return type(elem)(*(default_collate(list(field)) for field in zip(*batch)))
    if isinstance(elem, Sequence):
        if any(len(e) != len(elem) for e in batch):
            raise error(ErrorCode.SHAPE_MISMATCH, "default_collate: each element in list of batch should be of "
                        f"equal size, found sizes {[len(e) for e in batch]}")
        fields = [default_collate(list(field)) for field in zip(*batch)]
        return fields if isinstance(elem, tuple) else _same_type(elem, fields)
    raise error(ErrorCode.ATTRIBUTE_TYPE, "default_collate: a batch holds Tensors, numpy arrays, numbers, strings, "
                f"mappings or sequences, found {type(elem).__name__}")


def default_convert(item: Any) -> Any:
    """torch's default_convert (for `batch_size=None`): numpy arrays, anywhere in the item,
    become Tensors; everything else stays."""
    return _map(item, lambda a: Tensor.from_numpy(a) if a.dtype.kind not in "OSUV" else a, np.ndarray)


def _same_type(like: Any, value: Any) -> Any:
    """`value` (a dict or list) as `like`'s own container type where that type can be made
    from it, else as it is (torch's fallback)."""
    try:
        return type(like)(value)
    except TypeError:
        return value


class _Wired:
    """A Tensor's data on its way from a worker: numpy, so that the batch crosses the pipe
    as an array and becomes a Tensor again on the loader's side (a numpy array the
    dataset gave stays numpy)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array


def _map(obj: Any, fn: Callable[[Any], Any], leaf: type | tuple[type, ...]) -> Any:
    """`obj` with `fn` applied to every `leaf` inside its dicts, lists and tuples."""
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, Mapping):
        return _same_type(obj, {k: _map(v, fn, leaf) for k, v in obj.items()})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map(v, fn, leaf) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn, leaf) for v in obj)
    return obj


def _fetch(dataset: Any, collate_fn: Callable[[list], Any] | None, indices: list[int]) -> Any:
    """The batch of `indices` (one index, converted, when collate_fn is None: no batching)."""
    if collate_fn is None:
        return default_convert(dataset[indices[0]])
    return collate_fn([dataset[i] for i in indices])


class DataLoader:
    """torch.utils.data.DataLoader over a map-style dataset (see the module doc).

    `shuffle` draws each pass's order, a permutation of the indices, from `generator` (a
    dtm.Generator, a seed, or None for dtm's default generator, so `dtm.manual_seed` makes
    it repeatable); the order is not torch's. `batch_size=None` yields single items,
    converted (`default_convert`) instead of collated. `timeout` (seconds, 0 for the
    default of WAIT_S) bounds each wait for a worker's batch."""

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool = False, num_workers: int = 0,
                 collate_fn: Callable[[list], Any] | None = None, drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Callable[[int], None] | None = None, multiprocessing_context: Any = None,
                 generator: Generator | int | None = None, prefetch_factor: int = 2):
        if batch_size is not None and batch_size < 1 or num_workers < 0 or prefetch_factor < 1 or timeout < 0:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"DataLoader: batch_size={batch_size}, num_workers={num_workers}, "
                        f"prefetch_factor={prefetch_factor}, timeout={timeout}: sizes must be >= 1 (num_workers "
                        ">= 0) and the timeout >= 0")
        if isinstance(dataset, Loader) and (num_workers or shuffle or drop_last or batch_size not in (1, None)):
            raise error(ErrorCode.ATTRIBUTE_VALUE, "DataLoader over a dtm.data.Loader yields the Loader's own "
                        "batches: give batch_size, shuffle and its seed to the Loader (it prefetches in a thread; "
                        "num_workers must be 0)")
        self.dataset, self.batch_size, self.shuffle, self.drop_last = dataset, batch_size, shuffle, drop_last
        self.num_workers, self.prefetch_factor, self.worker_init_fn = num_workers, prefetch_factor, worker_init_fn
        self.collate_fn = None if batch_size is None else collate_fn or default_collate
        self.timeout = timeout or WAIT_S
        self.multiprocessing_context = multiprocessing_context
        self.generator = Generator().manual_seed(generator) if isinstance(generator, int) else \
            generator or GENERATOR

    def __len__(self) -> int:
        if isinstance(self.dataset, Loader):
            return self.dataset.windows // self.dataset.batch_size
        n, size = len(self.dataset), self.batch_size or 1
        return n // size if self.drop_last else math.ceil(n / size)

    def _batches(self) -> list[list[int]]:
        """This pass's batches of indices, in the order drawn for it."""
        n = len(self.dataset)
        order = np.random.default_rng(self.generator.next_key().tolist()).permutation(n) if self.shuffle else \
            np.arange(n)
        size = self.batch_size or 1
        return [order[i:i + size].tolist() for i in range(0, len(self) * size, size)]

    def __iter__(self) -> Iterator:
        if isinstance(self.dataset, Loader):
            return (batch for _, batch in zip(range(len(self)), self.dataset))
        batches = self._batches()
        if not self.num_workers:
            return (_fetch(self.dataset, self.collate_fn, b) for b in batches)
        return _Workers(self).run(batches)


class _Workers:
    """One pass's worker processes (see the module doc); `run` yields the batches."""

    def __init__(self, loader: DataLoader):
        ctx = loader.multiprocessing_context
        if not isinstance(ctx, mp.context.BaseContext):
            ctx = mp.get_context(ctx or ("fork" if "fork" in mp.get_all_start_methods() else "spawn"))
        self.timeout, self.depth = loader.timeout, loader.prefetch_factor * loader.num_workers
        # each worker seeds dtm's default generator apart, from the loader's, as torch seeds its workers
        seed = int(np.random.default_rng(loader.generator.next_key().tolist()).integers(2 ** 31))
        self.procs, self.tasks, self.results = [], [], []
        for w in range(loader.num_workers):
            task_r, task_w = ctx.Pipe(duplex=False)
            result_r, result_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker_loop, name=f"dtm-dataloader-{w}", daemon=True,
                            args=(w, loader.dataset, loader.collate_fn, loader.worker_init_fn, seed + w, task_r,
                                  result_w, os.getpid()))
            p.start()
            task_r.close()  # the worker's ends: closed here, so that its death reads as the end of its pipe
            result_w.close()
            self.procs.append(p)
            self.tasks.append(task_w)
            self.results.append(result_r)

    def run(self, batches: list[list[int]]) -> Iterator:
        finished = False
        try:
            for k in range(min(self.depth, len(batches))):
                self._ask(k, batches[k])
            for k in range(len(batches)):
                batch = self._receive(k)
                if k + self.depth < len(batches):
                    self._ask(k + self.depth, batches[k + self.depth])
                yield batch
            finished = True
        finally:
            self.close(wait=finished)

    def _ask(self, k: int, indices: list[int]) -> None:
        w = k % len(self.procs)
        try:
            self.tasks[w].send(indices)
        except (BrokenPipeError, OSError):
            raise self._lost(w, k) from None

    def _receive(self, k: int) -> Any:
        """Batch k, from worker k % num_workers (each worker answers its batches in order)."""
        w = k % len(self.procs)
        conn = self.results[w]
        if not conn.poll(self.timeout):
            raise DTMError(ErrorCode.TIMEOUT, f"DataLoader worker {w} (pid {self.procs[w].pid}) did not return "
                           f"batch {k} within {self.timeout:g} s")
        try:
            batch, failure = conn.recv()
        except (EOFError, OSError):
            raise self._lost(w, k) from None
        if failure is not None:
            kind, message = failure
            raise kind(message)
        return _map(batch, lambda wired: Tensor.from_numpy(wired.array), _Wired)

    def _lost(self, w: int, k: int) -> DTMError:
        p = self.procs[w]
        p.join(STOP_S)
        return DTMError(ErrorCode.WORKER_LOST, f"DataLoader worker {w} (pid {p.pid}) exited unexpectedly (exit code "
                        f"{p.exitcode}) before returning batch {k}")

    def close(self, wait: bool) -> None:
        """Tell each worker to stop; terminate those that have not within STOP_S, or at
        once when not `wait` (after an error or a loop left early, a worker may still be
        busy with a batch nobody will read)."""
        for conn in self.tasks:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass  # that worker is gone already
        for p in self.procs:
            p.join(STOP_S if wait else 0)
            if p.is_alive():
                p.terminate()
                p.join(STOP_S)
        for conn in self.tasks + self.results:
            conn.close()


def _worker_loop(worker_id: int, dataset: Any, collate_fn: Callable[[list], Any] | None,
                 init_fn: Callable[[int], None] | None, seed: int, tasks: Connection, results: Connection,
                 parent: int) -> None:
    """A worker: fetch and collate each batch asked for, and send it back with its Tensors
    as numpy; a failure goes back as the exception's type (builtin ones; others become
    RuntimeError) and a message with the worker's traceback, as torch re-raises them."""
    GENERATOR.manual_seed(seed)
    if init_fn is not None:
        init_fn(worker_id)
    while True:
        if not tasks.poll(IDLE_CHECK_S):
            if os.getppid() != parent:  # the loader's process is gone: nobody will ask again
                return
            continue
        try:
            indices = tasks.recv()
        except EOFError:
            return
        if indices is None:
            return
        try:
            batch = _map(_fetch(dataset, collate_fn, indices), lambda t: _Wired(t.numpy()), Tensor)
            results.send((batch, None))
        except Exception as e:  # noqa: BLE001 - sent to the loader, raised there
            results.send((None, _failure(worker_id, e)))


def _failure(worker_id: int, e: Exception) -> tuple[type, str]:
    kind = type(e) if type(e).__module__ == "builtins" else RuntimeError
    return kind, f"{type(e).__name__} in DataLoader worker {worker_id} (pid {os.getpid()}):\n{traceback.format_exc()}"


__all__ = ["Dataset", "TensorDataset", "DataLoader", "default_collate", "default_convert"]
