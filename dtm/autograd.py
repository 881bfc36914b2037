"""`backward()`: capture the program that computed a loss as IR, differentiate it with the
compiler's autodiff transform (so the backward pass is IR too), run both in one program,
and accumulate `.grad` on the leaves, as `torch.Tensor.backward` does."""

from __future__ import annotations

import numpy as np

from .compiler.autodiff import grad
from .errors import ErrorCode
from .tensor import Tensor, capture, error, realize
from .runtime.backend import get_backend


def _frontier(root: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    """Walk the graph of tensors that require grad: the leaves that require grad, and the
    pending tensors that do not (computed first, so no gradient flows through them)."""
    leaves, pending_consts, seen = [], [], set()
    stack = [root]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if not t.requires_grad:
            if t._buffer is None:
                pending_consts.append(t)
            continue
        if t._op is None:
            leaves.append(t)
            continue
        stack.extend(t._inputs)
    return leaves, pending_consts


def backward(loss: Tensor, gradient: Tensor | None = None, backend: str | None = None) -> None:
    if not loss.requires_grad:
        raise error(ErrorCode.ATTRIBUTE_VALUE, "backward(): this tensor does not require grad "
                    "(no input has requires_grad=True, or it was computed under no_grad)")
    if gradient is None and loss.numel() != 1:
        raise error(ErrorCode.SHAPE_MISMATCH, f"backward(): a gradient is needed for a non-scalar output {loss.type}")
    leaves, consts = _frontier(loss)
    realize(*consts)
    # Recompute requires-grad intermediates, so autodiff sees every op between leaves and loss.
    module, params = capture([loss], keep=lambda t: t.requires_grad and t._op is not None)
    wrt = [i for i, p in enumerate(params) if p.requires_grad and p._op is None]
    inputs = [p._buffer for p in params]
    if gradient is not None:
        g = gradient if isinstance(gradient, Tensor) else Tensor.from_numpy(np.asarray(gradient))
        if g.type != loss.type:
            raise error(ErrorCode.SHAPE_MISMATCH, f"backward(): gradient is {g.type}, the output is {loss.type}")
        inputs.append(g.numpy())
    name = grad(module, "main", wrt, seed="ones" if gradient is None else "param")
    if module.meshes:
        _backward_distributed(loss, module, name, params, wrt, g if gradient is not None else None)
        return
    results = get_backend(backend).run(module, name, inputs)
    if loss._buffer is None:
        loss._buffer = results[0]
    for i, g in zip(wrt, results[1:]):
        leaf = params[i]
        if leaf.grad is None:
            leaf.grad = Tensor.from_numpy(g)
        else:
            leaf.grad = Tensor.from_numpy(leaf.grad.numpy() + g)


def _backward_distributed(loss: Tensor, module, name: str, params: list[Tensor], wrt: list[int],
                          seed: Tensor | None) -> None:
    """The gradient program of a distributed forward: each gradient is brought to its leaf's
    placements (an all_reduce for a replicated leaf of sharded data, a reduce_scatter for a
    sharded one), then the program is partitioned and run on the mesh (dtm.parallel)."""
    from .parallel.dtensor import run_distributed

    f = module.funcs[name]
    for k, i in enumerate(wrt, start=1):  # results: loss, then one gradient per wrt
        leaf = params[i]
        if leaf._mesh is not None:
            f.result_types[k] = (f.result_types[k][0], leaf._mesh.sharding(leaf.placements))
    results = run_distributed(module, name, params + ([seed] if seed is not None else []))
    if loss._buffer is None:
        loss._buffer = results[0] if loss._mesh is not None else results[0].numpy()
        loss._placements = results[0].placements if loss._mesh is not None else None
    for i, g in zip(wrt, results[1:]):
        leaf = params[i]
        g = Tensor(leaf.type, buffer=g if leaf._mesh is not None else g.numpy())
        leaf.grad = g if leaf.grad is None else (leaf.grad + g).realize()

