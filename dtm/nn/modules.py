"""Modules, as in torch.nn: a `Module` owns `Parameter`s and sub-modules found through its
attributes, and names them for `state_dict`."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any, ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView

import numpy as np

from .. import functional as F
from .. import quant
from ..errors import ErrorCode
from ..ir.types import TensorType
from ..runtime import buffers
from ..tensor.core import STATE, realize
from ..tensor import (Tensor, as_dtype, bfloat16, error, float16, float32, float64, int64, no_grad, rand, randn, tensor,
                      zeros, ones)
from ..functional import _check_p
from .functional import (_no_legacy_reduction, batch_norm, binary_cross_entropy, binary_cross_entropy_with_logits,
                         cross_entropy, dropout, embedding, group_norm, l1_loss, mse_loss, nll_loss, rms_norm)
from .functional import _conv_tuple, _same_padding, conv1d, conv2d
from .weights import load_safetensors, save_safetensors


class _Depth(threading.local):
    depth = 0  # Module calls this thread is inside


_OUTERMOST = _Depth()


class Parameter(Tensor):
    """A leaf tensor that a Module trains: requires grad unless told otherwise."""

    __slots__ = ()

    def __init__(self, data: Tensor, requires_grad: bool = True):
        data.realize()
        super().__init__(data._type, buffer=data._buffer)
        if requires_grad:
            self.requires_grad_(True)


class Module:
    """torch.nn.Module: the base of every layer. A Parameter or Module assigned to an
    attribute is registered (a subclass calls `super().__init__()` before assigning any),
    `register_buffer` adds untrained state, and the walks (named_parameters, state_dict,
    load_state_dict, train/eval, to(dtype)) follow the sub-modules. Calling it runs
    `forward`; the outermost call from eager code first computes its pending inputs that
    need no gradient, and after, its outputs that need none."""

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent_buffers", set())
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

    def register_buffer(self, name: str, value: Tensor, persistent: bool = True) -> None:
        """State that is not trained (e.g. a running statistic, a causal mask). It is in
        state_dict unless `persistent` is False: a value the module can always rebuild
        need not be saved."""
        self._buffers[name] = value
        if persistent:
            self._non_persistent_buffers.discard(name)
        else:
            self._non_persistent_buffers.add(name)
        object.__setattr__(self, name, value)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def __call__(self, *args, **kwargs):
        if _OUTERMOST.depth or STATE.tracing:
            return self.forward(*args, **kwargs)
        # A model called from eager code computes, as torch's does, where nothing needs its
        # graph: its pending inputs first, and its outputs when they need no gradient (under
        # no_grad, say). Otherwise a loop that feeds one call's result to the next (sampling
        # that appends a token to the ids) records one program of every iteration, which
        # grows and compiles anew at each read; called step by step, each call is one
        # program of the same structure, which compiles once for every size
        # (dtm.tensor.dynamic).
        _OUTERMOST.depth += 1
        try:
            realize(*[a for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and not a.requires_grad])
            out = self.forward(*args, **kwargs)
        finally:
            _OUTERMOST.depth -= 1
        results = out if isinstance(out, (tuple, list)) else (out,)
        realize(*[t for t in results if isinstance(t, Tensor) and not t.requires_grad])
        return out

    # -- walking --
    def named_modules(self, memo: set | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, "Module"]]:
        """torch.nn.Module.named_modules: (name, module) for this module and every sub-module,
        depth first; a module held in two places comes once, under its first name (every time
        with remove_duplicate=False, as state_dict walks them)."""
        memo = set() if memo is None else memo
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            yield from m.named_modules(memo, f"{prefix}.{name}" if prefix else name, remove_duplicate)

    def modules(self) -> Iterator["Module"]:
        for _, m in self.named_modules():
            yield m

    def children(self) -> Iterator["Module"]:
        yield from self._modules.values()

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        seen = set()
        for mname, m in self.named_modules(prefix=prefix):
            for pname, p in m._parameters.items():
                if id(p) in seen:  # tied weights appear once
                    continue
                seen.add(id(p))
                yield (f"{mname}.{pname}" if mname else pname), p

    def parameters(self) -> Iterator[Parameter]:
        for _, p in self.named_parameters():
            yield p

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        """Every registered buffer with its dotted name, non-persistent ones too (as torch)."""
        seen = set()
        for mname, m in self.named_modules(prefix=prefix):
            for bname, b in m._buffers.items():
                if id(b) not in seen:  # a buffer shared by two modules appears once
                    seen.add(id(b))
                    yield (f"{mname}.{bname}" if mname else bname), b

    def buffers(self) -> Iterator[Tensor]:
        for _, b in self.named_buffers():
            yield b

    def train(self, mode: bool = True) -> "Module":
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.nn.Module.zero_grad: every parameter's gradient to None, or with
        set_to_none=False each existing gradient set to zeros in place."""
        for p in self.parameters():
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()

    def apply(self, fn) -> "Module":
        for m in self.modules():
            fn(m)
        return self

    # -- dtype --
    def to(self, *args, **kwargs) -> "Module":
        """module.to(dtype), .to("cpu"), .to("cpu", dtype), .to(tensor) (its dtype; another
        device than the CPU is an error): the
        float parameters and buffers take the dtype in place, as in torch, so an optimizer
        made before keeps holding them; integer ones keep theirs."""
        dtype = F._to_dtype(args, kwargs)
        if dtype is None:
            return self
        dtype = as_dtype(dtype)
        if not dtype.is_float:
            raise error(ErrorCode.DTYPE_MISMATCH, f"Module.to only accepts float dtypes, found {dtype}")
        seen = set()
        with no_grad():
            for m in self.modules():
                for t in (*m._parameters.values(), *m._buffers.values()):
                    if id(t) in seen or not t.dtype.is_float or t.dtype is dtype:
                        continue
                    seen.add(id(t))  # a tied weight is cast once
                    t._set_value(F.cast(t, dtype).numpy())
                    t._type = TensorType(dtype, t.shape)
                    if t.grad is not None:
                        t.grad = F.cast(t.grad, dtype)
        return self

    def cpu(self) -> "Module":
        """Where the module already is: DTM's tensors live on the CPU."""
        return self

    def half(self) -> "Module":
        return self.to(float16)

    def bfloat16(self) -> "Module":
        return self.to(bfloat16)

    def float(self) -> "Module":
        return self.to(float32)

    def double(self) -> "Module":
        return self.to(float64)

    # -- state --
    def state_dict(self) -> "OrderedDict[str, Tensor]":
        out: OrderedDict[str, Tensor] = OrderedDict()
        for mname, m in self.named_modules(remove_duplicate=False):  # (a shared module under each name, as torch)
            for table in (m._parameters, m._buffers):
                for name, t in table.items():
                    if table is m._buffers and name in m._non_persistent_buffers:
                        continue
                    out[f"{mname}.{name}" if mname else name] = t
        return out

    def load_state_dict(self, state: dict[str, Any], strict: bool = True, assign: bool = False) -> None:
        """Copy values into this module's tensors; shapes must match. With strict, the keys
        must be exactly this module's. assign=True (torch's): a tensor takes a value of its
        own dtype as it is, without a copy (a weight still on disk, from
        load_safetensors(path, mmap=True), stays there until it is used)."""
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            raise error(ErrorCode.UNDEFINED_VALUE, f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for k, t in own.items():
            if k not in state:
                continue
            v = state[k]
            if v is t:  # already this tensor (a loader that set it, e.g. a narrow weight)
                continue
            if isinstance(v, Tensor) and t._mesh is not None and v._mesh == t._mesh and v.dtype == t.dtype:
                v.realize()  # a distributed value laid out as the tensor is (a checkpoint read for it):
                if v._placements == t._placements and v.shape == t.shape:  # its pieces, no gather
                    t._set_value(v._buffer)
                    continue
            if is_narrow(t) or (isinstance(v, Tensor) and v.dtype.is_quant):
                self._load_narrow(k, t, v, assign)
                continue
            arr = v.numpy() if isinstance(v, Tensor) else np.asarray(v)
            if tuple(arr.shape) != t.shape:
                raise error(ErrorCode.SHAPE_MISMATCH, f"load_state_dict: {k} is {t._type} here, {arr.shape} in the state")
            own = t.numpy().dtype
            # (a copy: a weight read often goes on huge pages)
            t._set_value(arr if assign and arr.dtype == own else buffers.copy(arr, own))

    @staticmethod
    def _load_narrow(k: str, t: Tensor, v: Any, assign: bool) -> None:
        """load_state_dict for a narrow weight (dtm.quant) or from a quantized value: the
        same dtype and shape take the value's storage; float values into a narrow weight are
        quantized (the reference quantizer, as dtm.quant.quantize); anything else, a
        quantized value into a float tensor among them, is E0408 (no silent bytes)."""
        if isinstance(v, Tensor) and v._type == t._type:
            storage = v.numpy()
            t._set_value(storage if assign else buffers.copy(storage))
            return
        arr = v.numpy() if isinstance(v, Tensor) else np.asarray(v)
        source = v._type if isinstance(v, Tensor) else f"{arr.dtype}{list(arr.shape)}"
        if is_narrow(t) and tuple(arr.shape) == t.shape and arr.dtype.kind == "f":  # (block storage is uint8)
            t._set_value(buffers.copy(quant.quantize_weight(arr, t.dtype, k)))
            return
        hint = ("; make the model narrow first (dtm.quant.quantize(model, ...)) to load quantized weights"
                if not is_narrow(t) else "")
        raise error(ErrorCode.QUANTIZED_MISUSE, f"load_state_dict: {k} is {t._type} here, {source} in the state{hint}")

    def save(self, path: str) -> None:
        save_safetensors(self.state_dict(), path)

    def load(self, path: str, strict: bool = True, mmap: bool = False) -> None:
        """load_state_dict from a safetensors file; mmap=True maps it instead of reading it
        (load_safetensors) and assigns the mapped values (nothing read until used)."""
        self.load_state_dict(load_safetensors(path, mmap=mmap), strict, assign=mmap)

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


class NarrowParameter(Parameter):
    """A frozen weight that dtm.quant made narrow: read widened to f32 where it is used, the
    compiled products reading it narrow. (A model cast with `.bfloat16()` holds ordinary bf16
    Parameters instead, computed in bf16 as torch does.)"""

    __slots__ = ()


def narrow_parameter(storage: np.ndarray, dtype, shape: tuple[int, ...]) -> NarrowParameter:
    """A NarrowParameter of narrow dtype (dtm.quant) over its storage (uint8 blocks for q8_0
    and q4_0, bfloat16 values), with the logical type the compiled products read."""
    quant.check_storage("weight", storage, dtype, tuple(shape))
    return NarrowParameter(Tensor(TensorType(dtype, tuple(shape)), buffer=storage), requires_grad=False)


def _narrow(weight: Tensor, dtype, name: str) -> NarrowParameter:
    return narrow_parameter(buffers.copy(quant.quantize_weight(weight.numpy(), dtype, name)), dtype, weight.shape)


def is_narrow(t: Tensor) -> bool:
    """Whether `t` is a narrow weight made by dtm.quant (read widened to f32 where used)."""
    return isinstance(t, NarrowParameter)


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
        # a narrow weight is cast where it is read: the product absorbs the cast and reads the
        # weight narrow (dtm.compiler.schedule.narrow_weight)
        w = F.cast(self.weight, float32) if is_narrow(self.weight) else self.weight
        return F.linear(x, w, self.bias)

    def quantize_(self, dtype) -> None:
        """dtm.quant.quantize: the weight becomes narrow (the bias stays f32)."""
        self.weight = _narrow(self.weight, dtype, "Linear.weight")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """A table of `num_embeddings` vectors. The row at `padding_idx` starts as zeros and
    receives no gradient, so a padding token keeps its vector."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise error(ErrorCode.ATTRIBUTE_VALUE, f"Embedding: padding_idx {padding_idx} is out of range for "
                            f"{num_embeddings} embeddings")
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        weight = _normal((num_embeddings, embedding_dim))
        if padding_idx is not None:
            weight[padding_idx] = 0.0
        self.weight = Parameter(weight)

    def forward(self, ids: Tensor) -> Tensor:
        if is_narrow(self.weight):  # rows picked narrow, then widened (a frozen table: no padding gradient)
            return F.cast(F.take(self.weight, F.as_tensor(ids), 0, wrap=False), float32)
        return embedding(ids, self.weight, self.padding_idx)

    def quantize_(self, dtype) -> None:
        """dtm.quant.quantize: the table becomes narrow."""
        self.weight = _narrow(self.weight, dtype, "Embedding.weight")

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


class _ConvNd(Module):
    """Conv1d and Conv2d, which differ in their spatial rank (`_dims`) and functional form.
    Parameters `weight` [out, in / groups, *kernel_size] and `bias` [out], initialised as
    torch does: kaiming_uniform(a=sqrt(5)) for the weight, which is U(-b, b) with
    b = 1/sqrt(fan_in), and U(-b, b) for the bias. A padding_mode other than 'zeros' pads
    the input with `F.pad`'s mode of that name, then convolves with no padding, as torch."""

    _dims = 0
    _conv = staticmethod(conv1d)
    _PADDING_MODES = ("zeros", "reflect", "replicate", "circular")

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros"):
        super().__init__()
        name, dims = type(self).__name__, self._dims
        if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: groups must be a positive integer, found {groups!r}")
        if in_channels % groups:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: in_channels must be divisible by groups, found "
                        f"in_channels={in_channels}, groups={groups}")
        if out_channels % groups:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: out_channels must be divisible by groups, found "
                        f"out_channels={out_channels}, groups={groups}")
        self.kernel_size = _conv_tuple(name, "kernel_size", kernel_size, dims)
        self.stride = _conv_tuple(name, "stride", stride, dims)
        self.dilation = _conv_tuple(name, "dilation", dilation, dims)
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: Invalid padding string {padding!r}, should be one "
                            "of 'same', 'valid'")
            if padding == "same" and any(s != 1 for s in self.stride):
                raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: padding='same' is not supported for strided "
                            f"convolutions, found stride={self.stride}")
            self.padding = padding
        else:
            self.padding = _conv_tuple(name, "padding", padding, dims)
        if padding_mode not in self._PADDING_MODES:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: padding_mode must be one of "
                        f"{', '.join(map(repr, self._PADDING_MODES))}, but got padding_mode={padding_mode!r}")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.padding_mode = padding_mode
        # F.pad's (left, right) pairs, the last dim first, for a padding_mode other than zeros
        if self.padding == "same":
            low, high = _same_padding(self.dilation, self.kernel_size)
        else:
            low = high = (0,) * dims if self.padding == "valid" else self.padding
        self._reversed_padding_repeated_twice = [p for lo, hi in zip(reversed(low), reversed(high)) for p in (lo, hi)]
        fan_in = in_channels // groups * math.prod(self.kernel_size)
        bound = 1 / math.sqrt(fan_in) if fan_in else 0.0
        self.weight = Parameter(_uniform((out_channels, in_channels // groups) + self.kernel_size, bound))
        self.bias = Parameter(_uniform((out_channels,), bound)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if self.padding_mode == "zeros":
            return self._conv(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
        return self._conv(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)

    def extra_repr(self) -> str:
        # torch's, so that printed models read alike
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0,) * self._dims:
            s += f", padding={self.padding}"
        if self.dilation != (1,) * self._dims:
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode}"
        return s


class Conv1d(_ConvNd):
    """A 1-d convolution over [N, C_in, L] (or [C_in, L]): torch.nn.Conv1d."""

    _dims = 1
    _conv = staticmethod(conv1d)


class Conv2d(_ConvNd):
    """A 2-d convolution over [N, C_in, H, W] (or [C_in, H, W]): torch.nn.Conv2d."""

    _dims = 2
    _conv = staticmethod(conv2d)


class LayerNorm(Module):
    """torch.nn.LayerNorm: layer_norm over the trailing `normalized_shape` dims, times a
    weight (ones to start) plus a bias (zeros) when elementwise_affine; bias=False keeps the
    weight alone."""

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


class _BatchNorm(Module):
    """BatchNorm1d and BatchNorm2d, which differ only in the input ranks they take
    (`_ranks`). In training the batch's statistics normalise and, with
    track_running_stats, update the running_mean / running_var / num_batches_tracked
    buffers in place; in eval the running stats normalise. momentum=None weighs every
    batch alike (a cumulative average)."""

    _ranks: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        self.weight = Parameter(ones(num_features)) if affine else None
        self.bias = Parameter(zeros(num_features)) if affine else None
        if track_running_stats:
            self.register_buffer("running_mean", zeros(num_features))
            self.register_buffer("running_var", ones(num_features))
            self.register_buffer("num_batches_tracked", tensor(0, dtype=int64))
        else:  # as torch: the names exist, holding no state
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim not in self._ranks:
            raise error(ErrorCode.SHAPE_MISMATCH, f"{type(self).__name__}: expected a "
                        f"{' or '.join(f'{r}D' for r in self._ranks)} input, found {x._type}")
        updating = self.training and self.track_running_stats
        momentum = self._count_batch() if updating else 0.0
        # without running stats there is nothing else to normalise by, even in eval (as torch)
        return batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                          self.training or not self.track_running_stats, momentum, self.eps)

    def _count_batch(self) -> float | Tensor:
        """Count this batch; return the weight it gets in the running stats. For a cumulative
        average that is 1 / batches, a tensor read before the count's in-place update so
        that a jitted step recomputes it on every call."""
        with no_grad():
            weight = self.momentum
            if weight is None:
                weight = 1.0 / F.cast(self.num_batches_tracked + 1, self.running_mean.dtype)
            self.num_batches_tracked.add_(1)
        return weight

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


class BatchNorm1d(_BatchNorm):
    """Batch normalisation of [N, C] or [N, C, L] per channel C."""

    _ranks = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalisation of [N, C, H, W] per channel C."""

    _ranks = (4,)


class GroupNorm(Module):
    """Normalises each sample's `num_groups` groups of consecutive channels, then a
    per-channel affine (weight 1, bias 0 to start)."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True):
        super().__init__()
        if num_channels % num_groups:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"GroupNorm: num_channels {num_channels} is not divisible by "
                        f"num_groups {num_groups}")
        self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, eps, affine
        self.weight = Parameter(ones(num_channels)) if affine else None
        self.bias = Parameter(zeros(num_channels)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


class RMSNorm(Module):
    """x / sqrt(mean(x^2) + eps) over the trailing `normalized_shape` dims, times a weight
    (ones to start). eps=None: the input dtype's machine epsilon, as torch."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True):
        super().__init__()
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        self.weight = Parameter(ones(*self.normalized_shape)) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class Dropout(Module):
    """torch.nn.Dropout: in training, zeros each element with probability p and scales the
    rest by 1 / (1 - p) (p = 1 zeros everything); in eval, returns its input. p outside
    [0, 1] is an error when the module is made, as in torch."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        _check_p(p, "Dropout")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class GELU(Module):
    """torch.nn.GELU: gelu elementwise, exact (approximate="none") or with the tanh
    approximation (approximate="tanh"); integer inputs compute in the default float."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, self.approximate)


class ReLU(Module):
    """torch.nn.ReLU: max(x, 0) elementwise, in x's dtype."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class Tanh(Module):
    """torch.nn.Tanh: tanh elementwise; integer inputs compute in the default float."""

    def forward(self, x: Tensor) -> Tensor:
        return F.tanh(x)


class SiLU(Module):
    """torch.nn.SiLU: x * sigmoid(x) elementwise; integer inputs compute in the default float."""

    def forward(self, x: Tensor) -> Tensor:
        return F.silu(x)


class Identity(Module):
    """Returns its input; takes (and ignores) any arguments, as torch's does, so it can
    stand in for a layer that was configured away."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x: Tensor) -> Tensor:
        return x


class Softmax(Module):
    """torch.nn.Softmax: softmax along `dim`. dim=None takes torch's legacy choice (without
    its warning): dim 0 for inputs of rank 0, 1 or 3, else dim 1."""

    def __init__(self, dim: int | None = None):
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        # torch's legacy choice when no dim is given: dim 0 for ranks 0, 1 and 3, else dim 1
        dim = self.dim if self.dim is not None else 0 if x.ndim in (0, 1, 3) else 1
        return F.softmax(x, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Flatten(Module):
    """Flattens dims start_dim..end_dim into one; by default all but the batch dim."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: Tensor) -> Tensor:
        return F.flatten(x, self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


class Sequential(Module):
    """torch.nn.Sequential: the modules given, registered as "0", "1", ... (or by the names of
    an OrderedDict), called in order, each on the previous one's output; an int index gives a
    module, a slice a Sequential of those modules."""

    def __init__(self, *modules: Module):
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], dict):  # Sequential(OrderedDict(name=module, ...))
            for name, m in modules[0].items():
                setattr(self, name, m)
            return
        for i, m in enumerate(modules):
            setattr(self, str(i), m)

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x

    def __getitem__(self, i: int | slice) -> "Module":
        if isinstance(i, slice):
            return Sequential(dict(list(self._modules.items())[i]))
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)


class ModuleList(Module):
    """torch.nn.ModuleList: sub-modules in a list, registered as "0", "1", ...: append,
    index, iterate and len; it has no forward of its own."""

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


class ModuleDict(Module):
    """Sub-modules by name, in insertion order, registered like attributes."""

    def __init__(self, modules: Mapping[str, Module] | None = None):
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        if not isinstance(module, Module):
            raise error(ErrorCode.ATTRIBUTE_TYPE, f"ModuleDict[{key!r}] must be a Module, found {type(module).__name__}")
        setattr(self, key, module)

    def __delitem__(self, key: str) -> None:
        del self._modules[key]
        object.__delattr__(self, key)

    def __contains__(self, key: str) -> bool:
        return key in self._modules

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __len__(self) -> int:
        return len(self._modules)

    def keys(self) -> KeysView[str]:
        return self._modules.keys()

    def values(self) -> ValuesView[Module]:
        return self._modules.values()

    def items(self) -> ItemsView[str, Module]:
        return self._modules.items()

    def update(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]]) -> None:
        """Add or replace from a mapping or from (name, module) pairs."""
        for key, module in (modules.items() if hasattr(modules, "items") else modules):
            self[key] = module


class CrossEntropyLoss(Module):
    """torch.nn.CrossEntropyLoss, in torch's argument order: cross_entropy of logits and
    class ids, with class weights, ignore_index, reduction and label_smoothing (torch's
    deprecated size_average and reduce are refused)."""

    def __init__(self, weight: Tensor | None = None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__()
        _no_legacy_reduction("CrossEntropyLoss", size_average, reduce)
        self.weight, self.ignore_index, self.reduction, self.label_smoothing = \
            weight, ignore_index, reduction, label_smoothing

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(logits, target, weight=self.weight, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing)


class MSELoss(Module):
    """torch.nn.MSELoss: mse_loss, (input - target)^2 reduced as `reduction` says ('mean',
    'sum' or 'none')."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return mse_loss(input, target, self.reduction)


class L1Loss(MSELoss):
    """torch.nn.L1Loss: l1_loss, |input - target| reduced as `reduction` says. (A subclass of
    MSELoss here, for its constructor.)"""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return l1_loss(input, target, self.reduction)


class NLLLoss(Module):
    """torch.nn.NLLLoss: nll_loss of log-probabilities and class ids, with optional class
    weights, ignore_index and reduction."""

    def __init__(self, weight: Tensor | None = None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean"):
        super().__init__()
        _no_legacy_reduction("NLLLoss", size_average, reduce)
        self.weight, self.ignore_index, self.reduction = weight, ignore_index, reduction

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return nll_loss(input, target, weight=self.weight, ignore_index=self.ignore_index, reduction=self.reduction)


class BCELoss(Module):
    """torch.nn.BCELoss: binary_cross_entropy of probabilities `input` against `target`,
    times an optional elementwise weight, then reduced."""

    def __init__(self, weight: Tensor | None = None, size_average=None, reduce=None, reduction: str = "mean"):
        super().__init__()
        _no_legacy_reduction("BCELoss", size_average, reduce)
        self.weight, self.reduction = weight, reduction

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return binary_cross_entropy(input, target, weight=self.weight, reduction=self.reduction)


class BCEWithLogitsLoss(Module):
    """torch.nn.BCEWithLogitsLoss: binary_cross_entropy_with_logits, BCE of sigmoid(input)
    in a stable form, with an optional elementwise weight and pos_weight (the weight of the
    positive term)."""

    def __init__(self, weight: Tensor | None = None, size_average=None, reduce=None, reduction: str = "mean",
                 pos_weight: Tensor | None = None):
        super().__init__()
        _no_legacy_reduction("BCEWithLogitsLoss", size_average, reduce)
        self.weight, self.reduction, self.pos_weight = weight, reduction, pos_weight

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return binary_cross_entropy_with_logits(input, target, weight=self.weight, reduction=self.reduction,
                                                pos_weight=self.pos_weight)


__all__ = ["Module", "Parameter", "Linear", "Embedding", "LayerNorm", "Dropout", "GELU", "ReLU", "Tanh",
           "Sequential", "ModuleList", "CrossEntropyLoss", "no_grad", "SiLU", "Identity", "Softmax", "Flatten",
           "ModuleDict", "MSELoss", "L1Loss", "NLLLoss", "BCELoss", "BCEWithLogitsLoss"]
