"""Modules, as in torch.nn: a `Module` owns `Parameter`s and sub-modules found through its
attributes, and names them for `state_dict`."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Iterator

import numpy as np

from .. import functional as F
from ..errors import ErrorCode
from ..tensor import Tensor, error, no_grad, rand, randn, zeros, ones
from .functional import cross_entropy, dropout, embedding
from .weights import load_safetensors, save_safetensors


class Parameter(Tensor):
    """A leaf tensor that a Module trains: requires grad unless told otherwise."""

    __slots__ = ()

    def __init__(self, data: Tensor, requires_grad: bool = True):
        data.realize()
        super().__init__(data._type, buffer=data._buffer)
        if requires_grad:
            self.requires_grad_(True)


class Module:
    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise error(ErrorCode.UNDEFINED_VALUE, f"{type(self).__name__}.__init__ must call super().__init__() "
                        f"before setting {name!r}")
        for table in (self._parameters, self._modules, self._buffers):
            table.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def register_buffer(self, name: str, value: Tensor) -> None:
        """State saved in state_dict that is not trained (e.g. a running statistic)."""
        self._buffers[name] = value
        object.__setattr__(self, name, value)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    # -- walking --
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        yield prefix, self
        for name, m in self._modules.items():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self) -> Iterator["Module"]:
        for _, m in self.named_modules():
            yield m

    def children(self) -> Iterator["Module"]:
        yield from self._modules.values()

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        seen = set()
        for mname, m in self.named_modules(prefix):
            for pname, p in m._parameters.items():
                if id(p) in seen:  # tied weights appear once
                    continue
                seen.add(id(p))
                yield (f"{mname}.{pname}" if mname else pname), p

    def parameters(self) -> Iterator[Parameter]:
        for _, p in self.named_parameters():
            yield p

    def train(self, mode: bool = True) -> "Module":
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def apply(self, fn) -> "Module":
        for m in self.modules():
            fn(m)
        return self

    # -- state --
    def state_dict(self) -> "OrderedDict[str, Tensor]":
        out: OrderedDict[str, Tensor] = OrderedDict()
        for mname, m in self.named_modules():
            for table in (m._parameters, m._buffers):
                for name, t in table.items():
                    out[f"{mname}.{name}" if mname else name] = t
        return out

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Copy values into this module's tensors; shapes must match. With strict, the keys
        must be exactly this module's."""
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            raise error(ErrorCode.UNDEFINED_VALUE, f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for k, t in own.items():
            if k not in state:
                continue
            v = state[k]
            arr = v.numpy() if isinstance(v, Tensor) else np.asarray(v)
            if tuple(arr.shape) != t.shape:
                raise error(ErrorCode.SHAPE_MISMATCH, f"load_state_dict: {k} is {t._type} here, {arr.shape} in the state")
            t._set_value(np.array(arr, dtype=t.numpy().dtype, copy=True))

    def save(self, path: str) -> None:
        save_safetensors(self.state_dict(), path)

    def load(self, path: str, strict: bool = True) -> None:
        self.load_state_dict(load_safetensors(path), strict)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, m in self._modules.items():
            lines.append(f"  ({name}): " + repr(m).replace("\n", "\n  "))
        return "\n".join(lines) + (")" if len(lines) == 1 else "\n)")


class no_init:  # noqa: N801 - a context manager, named like no_grad
    """Inside this context modules allocate their parameters as zeros instead of drawing
    random initial values: for models whose weights are set right after (a checkpoint
    load, their own initialisation), as HF's no_init_weights and torch's skip_init do.
    Drawing GPT-2's 124M initial values only to overwrite them costs seconds."""

    depth = 0

    def __enter__(self):
        no_init.depth += 1
        return self

    def __exit__(self, *exc):
        no_init.depth -= 1


def _uniform(shape, bound: float) -> Tensor:
    return zeros(*shape) if no_init.depth else rand(*shape) * (2 * bound) - bound


def _normal(shape) -> Tensor:
    return zeros(*shape) if no_init.depth else randn(*shape)


class Linear(Module):
    """y = x @ W^T + b, W of shape [out, in], initialised as torch does."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        self.weight = Parameter(_uniform((out_features, in_features), bound))
        self.bias = Parameter(_uniform((out_features,), bound)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = Parameter(_normal((num_embeddings, embedding_dim)))

    def forward(self, ids: Tensor) -> Tensor:
        return embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LayerNorm(Module):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True):
        super().__init__()
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        self.weight = Parameter(ones(*self.normalized_shape)) if elementwise_affine else None
        self.bias = Parameter(zeros(*self.normalized_shape)) if elementwise_affine and bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class Dropout(Module):
    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class GELU(Module):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, self.approximate)


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class Tanh(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.tanh(x)


class Sequential(Module):
    def __init__(self, *modules: Module):
        super().__init__()
        for i, m in enumerate(modules):
            setattr(self, str(i), m)

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)


class ModuleList(Module):
    def __init__(self, modules=()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, m: Module) -> None:
        setattr(self, str(len(self._modules)), m)

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


class CrossEntropyLoss(Module):
    def __init__(self, ignore_index: int = -100, reduction: str = "mean"):
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(logits, target, ignore_index=self.ignore_index, reduction=self.reduction)


__all__ = ["Module", "Parameter", "Linear", "Embedding", "LayerNorm", "Dropout", "GELU", "ReLU", "Tanh",
           "Sequential", "ModuleList", "CrossEntropyLoss", "no_grad"]
