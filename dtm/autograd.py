"""torch.autograd's functional face: `dtm.autograd.grad`, and the grad-mode managers
under the names torch.autograd also gives them. The gradients are computed as everywhere
in DTM: the forward is captured as IR and differentiated by the compiler's autodiff
transform (dtm.compiler.autodiff), then run, or recorded with history for create_graph."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .compiler.autodiff import grad as grad_ir
from .errors import ErrorCode, user_error as error
from .tensor import Tensor, enable_grad, inference_mode, is_grad_enabled, no_grad  # noqa: F401 - torch.autograd's names
from .tensor.core import STATE, _free, _frontier, _recomputed, capture, module_mesh, realize, record_func

__all__ = ["grad", "no_grad", "enable_grad", "inference_mode", "is_grad_enabled"]


def _as_list(xs) -> list[Tensor]:
    return [xs] if isinstance(xs, Tensor) else list(xs)


def _reaches(outputs: Sequence[Tensor], target: Tensor) -> bool:
    """Whether `target` is in the graph below `outputs`."""
    stack, seen = list(outputs), set()
    while stack:
        t = stack.pop()
        if t is target:
            return True
        if id(t) not in seen:
            seen.add(id(t))
            stack.extend(t._inputs)
    return False


def grad(outputs: Tensor | Sequence[Tensor], inputs: Tensor | Sequence[Tensor],
         grad_outputs: Tensor | Sequence[Tensor | None] | None = None, retain_graph: bool | None = None,
         create_graph: bool = False, allow_unused: bool | None = None) -> tuple[Tensor | None, ...]:
    """torch.autograd.grad: the sum over `outputs` of the vector-Jacobian products with
    `grad_outputs` (ones for scalar outputs), with respect to each of `inputs` (leaves or
    intermediates), returned rather than accumulated into `.grad`. With create_graph the
    gradients carry history (differentiable again); the graph is freed afterwards unless
    retain_graph (default: create_graph). An input the outputs do not depend on is an
    error, or None with allow_unused."""
    outs, ins = _as_list(outputs), _as_list(inputs)
    gouts = [None] * len(outs) if grad_outputs is None else _as_list(grad_outputs)
    if len(gouts) != len(outs):
        raise error(ErrorCode.OPERAND_COUNT, f"autograd.grad: {len(gouts)} grad_outputs for {len(outs)} outputs")
    for i, t in enumerate(ins):
        if not t.requires_grad:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"autograd.grad: input {i} ({t._type}) does not require grad")
    for i, o in enumerate(outs):
        if not o.requires_grad:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"autograd.grad: output {i} ({o._type}) does not require grad "
                        "(no input has requires_grad=True, or it was computed under no_grad)")
    # One scalar to differentiate: sum_i sum(out_i * g_i), recorded with history (the sum
    # of a scalar output times None is the output itself, so the common case adds no op).
    total = None
    with enable_grad():
        for o, g in zip(outs, gouts):
            if g is None:
                if o.numel() != 1:
                    raise error(ErrorCode.SHAPE_MISMATCH, f"autograd.grad: grad_outputs is needed for a non-scalar "
                                f"output {o._type}")
                term = o.reshape(())
            else:
                g = g if isinstance(g, Tensor) else Tensor.from_numpy(np.asarray(g))
                if g.shape != o.shape:
                    raise error(ErrorCode.SHAPE_MISMATCH, f"autograd.grad: grad_output {g._type} for an output "
                                f"{o._type}")
                term = (o * g.detach()).sum()
            total = term if total is None else total + term
    used = [_reaches([total], t) for t in ins]
    for i, u in enumerate(used):
        if not u and not allow_unused:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"autograd.grad: input {i} ({ins[i]._type}) is not used to "
                        "compute the outputs (pass allow_unused=True to get None for it)")
    _, consts, inner = _frontier(total)
    if STATE.trace is None:  # computed first, so no gradient flows through them (as backward() does)
        realize(*consts)
    module, params = capture([total], params=ins, keep=_recomputed)
    wrt = list(range(len(ins)))
    name = grad_ir(module, "main", wrt, seed="ones")
    # Recorded, not run: eagerly the gradients compute when read; inside dtm.jit they join
    # the traced program.
    results = record_func(module.funcs[name], params, history=create_graph, mesh=module_mesh(module))[1:]
    if not (create_graph if retain_graph is None else retain_graph):
        _free(inner)
    return tuple(r if u else None for r, u in zip(results, used))
