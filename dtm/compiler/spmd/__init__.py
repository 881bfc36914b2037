"""SPMD: from the global view (logical tensors with shardings) to the local view (one
program per rank with explicit collectives). docs/architecture.md, "Two views"; spec 2.7 and 2.9.

    layout.py        chunks of sharded dims, local types, sharding checks, host split/assemble
    rules.py         a sharding rule per registry op (RULES), the replicated fallback
    propagate.py     every value gets a sharding (`propagate_shardings`, `choose`); open
                     (FREE) axes of pinned shardings filled (`resolve_free`)
    redistribute.py  the steps between two shardings (`plan`) and their local ops
    partition.py     global-view Func -> the local-view Func of one rank (`partition`)
    bucket.py        local view: returned-only all_reduces merged into buckets (DDP)

    g = propagate_shardings(module, "mlp")          # global view, every value placed
    f0 = partition(module, "mlp", rank=0)           # rank 0's local view
    print(dtm.ir.format(local_module(module, "mlp", rank=0)))
"""

from .bucket import bucket_all_reduces
from .layout import assemble, local_type, split_array
from .partition import local_module, partition, partition_all
from .propagate import FREE, choose, propagate_shardings, resolve_free
from .redistribute import Step, plan
from .rules import RULES, Strategy

__all__ = ["propagate_shardings", "resolve_free", "FREE", "partition", "local_module", "partition_all",
           "bucket_all_reduces", "choose", "plan", "Step",
           "RULES", "Strategy", "local_type", "split_array", "assemble"]
