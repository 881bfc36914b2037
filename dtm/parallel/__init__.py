"""Many devices, one program: meshes, distributed tensors, shard_map and the parallel
models built from them (DESIGN.md, "Two views of a distributed program").

    mesh.py             Mesh, devices(), placements (Shard, Replicate, Partial)
    dtensor.py          distributed tensors: distribute, redistribute, full_tensor, local_shards
    shard_map.py        shard_map: the local view, with explicit collectives
    collectives.py      all_reduce, all_gather, reduce_scatter, all_to_all, broadcast
    ddp.py              DDP (and the bucketing of gradient all_reduces)
    tensor_parallel.py  tensor_parallel: Megatron-style column / row parallel layers
    fsdp.py             fsdp: parameters sharded, gathered for use

Programs run on the in-process devices of dtm.runtime.l0.
"""

from ..ir.types import Partial, Placement, Replicate, Shard
from .collectives import all_gather, all_reduce, all_to_all, broadcast, reduce_scatter
from .ddp import DDP
from .dtensor import distribute
from .fsdp import FSDP, fsdp
from .mesh import Mesh, devices
from .shard_map import shard_map
from .tensor_parallel import GPT2_PLAN, tensor_parallel

__all__ = ["Mesh", "devices", "Shard", "Replicate", "Partial", "Placement", "distribute", "shard_map", "all_reduce",
           "all_gather", "reduce_scatter", "all_to_all", "broadcast", "DDP", "FSDP", "fsdp", "tensor_parallel",
           "GPT2_PLAN"]
