"""DTM, the Distributed Tensor Machine: write a tensor program once and run it on one
device, many devices, or many hosts. `dtm.ir` is the language-agnostic IR every layer
shares; `dtm.Tensor` the lazy, torch-like front end. See README.md for the tour and
docs/spec/dtm-spec.md for the normative spec."""

import sys as _sys
import types as _types

from . import ir
from .errors import DTMError, ErrorCode, TensorError
from .ir.version import PACKAGE_VERSION as __version__
from .tensor import (Tensor, arange, as_dtype, bfloat16, bool_, float8_e4m3, float8_e4m3fn, float8_e5m2, float16, float32, float64,
                     from_dlpack, from_numpy, full, full_like, int8, int16, int32, int64, is_grad_enabled, jit,
                     manual_seed, no_grad, ones, ones_like, promote_types, rand, rand_like, randn, randn_like, realize,
                     result_type, tensor, uint8, uint16, uint32, uint64, zeros, zeros_like)
from .functional import *  # noqa: F401,F403 - torch-style dtm.cat, dtm.where, dtm.softmax, ...
from . import functional, nn, optim  # noqa: E402
from .tensor import inplace  # noqa: E402,F401 - in-place ops and views, over functional's methods
from .nn.serialization import load, save  # noqa: E402 - dtm.save / dtm.load, as torch.save / torch.load
from .tensor import Generator, enable_grad, inference_mode, randint  # noqa: E402
from .tensor.extra_ops import (all, allclose, any, argsort, bmm, cumsum, einsum, empty, isclose, isnan,  # noqa: E402
                               linspace, multinomial, norm, outer, randperm, sort, topk, unbind)
globals().update({_name: inplace.view_function(_name) for _name in inplace.VIEW_FUNCTIONS})  # views, as torch's
from . import autograd  # noqa: E402 - dtm.autograd.grad
from . import parallel  # noqa: E402
from .parallel import Mesh, Partial, Replicate, Shard, devices, distribute, shard_map  # noqa: E402
from . import distributed  # noqa: E402 - the collectives: recorded in a shard_map, or between processes
from .distributed import (all_gather, all_reduce, all_to_all, barrier, broadcast, recv,  # noqa: E402
                          reduce_scatter, send)
from . import debug  # noqa: E402 - dtm.debug.count_kernels(...), as the README shows
from .comm import CollectiveMismatch, PeerLost  # noqa: E402 - what a failed collective raises
from .protocol import ChecksumError  # noqa: E402
from .runtime.process_group import cancel, init, rank, shutdown, world_size  # noqa: E402
from .cluster.cancel import Cancelled  # noqa: E402 - what every rank's operations raise after dtm.cancel
from .runtime.cpu import get_num_threads, set_num_threads  # noqa: E402 - the cpu backend's OpenMP threads
from . import store  # noqa: E402 - dtm.store.open(), the tensor store
from .ref.context import bind_process_store  # noqa: E402
from . import tasks  # noqa: E402 - dtm.tasks.Graph, task graphs over the store
from . import ckpt as checkpoint  # noqa: E402 - dtm.checkpoint.save / load / list (spec 9.4)
from . import elastic  # noqa: E402 - dtm.elastic.steps, training through live mesh resize (spec 9.6.7)
_sys.modules.setdefault("dtm.checkpoint", checkpoint)

# the store (layer 8) returns Tensors, plain or distributed (a Shards value), without importing them
store.set_tensor_factory(Tensor.from_numpy, lambda type, value: Tensor(type, buffer=value))
tasks.install(jit=jit, tensor=Tensor.from_numpy)  # task functions take Tensors and are jitted, layer 8 below them
bind_process_store(store.current)  # programs' store_get / store_put (layer 2) use the process's store
from . import data  # noqa: E402 - dtm.data.ingest / dtm.data.Loader
data.set_tensor_factory(Tensor.from_numpy)  # the loader (layer 8) yields Tensors without importing them
from . import utils  # noqa: E402 - dtm.utils.data, as torch.utils.data
from .tensor.autocast import _CpuAutocast, autocast, get_autocast_dtype, is_autocast_enabled  # noqa: E402 - CPU autocast
amp = _sys.modules.setdefault("dtm.amp", _types.ModuleType("dtm.amp", "torch.amp: dtm.amp.autocast"))  # no file of its own
amp.autocast = autocast
cpu = _sys.modules.setdefault("dtm.cpu", _types.ModuleType("dtm.cpu", "torch.cpu: dtm.cpu.amp.autocast"))
cpu.amp = _sys.modules.setdefault("dtm.cpu.amp", _types.ModuleType("dtm.cpu.amp", "torch.cpu.amp"))
cpu.amp.autocast = _CpuAutocast

# torch's short dtype names
half, double, long = float16, float64, int64
bool = bool_  # noqa: A001 - dtm.bool, as torch.bool
float = float32  # noqa: A001
int = int32  # noqa: A001

__all__ = ["ir", "nn", "optim", "functional", "parallel", "distributed", "debug", "store", "tasks", "checkpoint", "data", "DTMError", "ErrorCode", "TensorError", "Tensor", "tensor", "__version__"]
