"""Many devices, one program: meshes, distributed tensors, shard_map and the parallel
models built from them (docs/architecture.md, "Two views of a distributed program").

    mesh.py             Mesh (making and slicing meshes; the runtime's DeviceMesh does the
                        rest), devices(), placements (Shard, Replicate, Partial)
    dtensor.py          distribute, and `place` (DDP, TP and FSDP are made of it); a
                        distributed tensor's own methods (redistribute, full_tensor,
                        local_shards, placements) are the Tensor's, dtm/tensor.py
    shard_map.py        shard_map: the local view, with explicit collectives
    ddp.py              DDP (the bucketing of gradient all_reduces: dtm.compiler.spmd.bucket)
    tensor_parallel.py  tensor_parallel: Megatron-style column / row parallel layers
    fsdp.py             fsdp: parameters sharded, gathered for use

The collectives of the local view (all_reduce, all_gather, reduce_scatter, all_to_all,
broadcast) are dtm.distributed's, named here too. Programs run through dtm.runtime: on the
in-process devices (L0), or one rank per process after dtm.init() (L1).
"""

from ..distributed import all_gather, all_reduce, all_to_all, broadcast, reduce_scatter
from ..ir.types import Partial, Placement, Replicate, Shard
from .ddp import DDP
from .dtensor import distribute
from .fsdp import FSDP, fsdp
from .mesh import Mesh, devices
from .shard_map import shard_map
from .tensor_parallel import GPT2_PLAN, tensor_parallel

__all__ = ["Mesh", "devices", "Shard", "Replicate", "Partial", "Placement", "distribute", "shard_map", "all_reduce",
           "all_gather", "reduce_scatter", "all_to_all", "broadcast", "DDP", "FSDP", "fsdp", "tensor_parallel",
           "GPT2_PLAN"]
