"""Tensor parallelism, Megatron-style: layers split across an axis by their weights.

    tensor_parallel(model, mesh, {"h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}, axis="tp")

Keys of `plan` are module names (fnmatch patterns, as `named_modules` names them); values
are styles:

- "colwise" (Linear): output features split, weight [out, in] Shard(0), bias Shard(0). The
  output comes out sharded on its last dim; no communication.
- "rowwise" (Linear): input features split, weight Shard(1), bias replicated. Each rank's
  product is a partial sum, and the output is pinned to Replicate on `axis`: one
  all_reduce, at the layer. A colwise layer feeding a rowwise one (an MLP) thus costs one
  all_reduce in forward, and the activation between them never moves.
- "rowwise" (Embedding): the table split by rows (vocab-parallel): each rank looks up the
  rows it holds (a masked gather, zeros elsewhere) and one all_reduce joins them.
- "colwise" (Embedding): the table split by columns; the output sharded on its last dim.

Parameters the plan does not name are replicated on `axis`. Only shardings are set (and,
for rowwise, the output pin); the partitioner writes the collectives, in forward and in the
backward that autodiff derives from the same global program, and each gradient takes its
parameter's placements.

`GPT2_PLAN` is Megatron's split of GPT-2: attention c_attn colwise and c_proj rowwise, MLP
c_fc colwise and c_proj rowwise, the token embedding vocab-parallel. The model stores
c_attn's rows head by head ([q, k, v] of each head, dtm.models.gpt2), so each rank's rows
are whole heads: the reshape to [B, T, n_head, 3, head_dim] carries the split to the heads
dim, each rank attends over its own heads, and c_proj's all_reduce is the block's only
collective in attention (one more after the MLP). A model with HF's fused layout
([q of all heads | k | v]) would instead be moved to a split of the batch, by all_to_all.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Mapping

from ..errors import ErrorCode as E
from ..ir.types import Replicate, Shard
from ..nn import Embedding, Linear, Module
from ..tensor import error
from .dtensor import place
from .mesh import Mesh

GPT2_PLAN = {
    "h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise",
    "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise",
    "wte": "rowwise",
}


def _pin_output(m: Module, mesh: Mesh, axis: str) -> None:
    """Make m's output Replicate on `axis` (its other axes as propagation places them)."""
    inner = m.forward

    def forward(*args, **kwargs):
        return inner(*args, **kwargs).redistribute({axis: Replicate()})

    object.__setattr__(m, "forward", forward)


def tensor_parallel(model: Module, mesh: Mesh, plan: Mapping[str, str], axis: str = "tp") -> Module:
    """Split `model`'s layers over `axis` of `mesh` as `plan` says (see the module
    docstring); returns the model, changed in place."""
    if axis not in mesh.shape:
        raise error(E.UNKNOWN_MESH_AXIS, f"tensor_parallel: {mesh} has axes {list(mesh.axis_names)}, not {axis!r}")
    matched = set()
    for name, m in model.named_modules():
        hits = [pattern for pattern in plan if fnmatchcase(name, pattern)]
        matched.update(hits)
        styles = {plan[pattern] for pattern in hits}
        if not styles:
            continue
        if len(styles) > 1 or not styles <= {"colwise", "rowwise"}:
            raise error(E.ATTRIBUTE_VALUE, f"tensor_parallel: module {name!r} gets styles {sorted(styles)}; give it "
                        "one of \"colwise\", \"rowwise\"")
        style = styles.pop()
        what = f"tensor_parallel: {name}"
        if isinstance(m, Linear):
            place(m.weight, mesh, {axis: Shard(0 if style == "colwise" else 1)}, f"{what}.weight")
            if m.bias is not None:
                place(m.bias, mesh, {axis: Shard(0) if style == "colwise" else Replicate()}, f"{what}.bias")
        elif isinstance(m, Embedding):
            place(m.weight, mesh, {axis: Shard(0 if style == "rowwise" else 1)}, f"{what}.weight")
        else:
            raise error(E.ATTRIBUTE_VALUE, f"{what} is a {type(m).__name__}; \"{style}\" splits a Linear or an "
                        "Embedding")
        if style == "rowwise":
            _pin_output(m, mesh, axis)
    unused = [p for p in plan if p not in matched]
    if unused:
        raise error(E.UNDEFINED_VALUE, f"tensor_parallel: plan entries {unused} match no module of the model")
    for name, p in model.named_parameters():
        if p._mesh is None:
            place(p, mesh, {axis: Replicate()}, f"tensor_parallel: parameter {name}")
    return model


__all__ = ["tensor_parallel", "GPT2_PLAN"]
