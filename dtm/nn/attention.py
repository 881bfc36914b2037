"""nn.MultiheadAttention, as torch's: the same parameter names and layout (a torch
state_dict loads and gives torch's outputs), the same masks, layouts and returned weights."""

from __future__ import annotations

import math

from .. import functional as F
from ..errors import ErrorCode
from ..tensor import Tensor, bool_, error, zeros, zeros_like
from .modules import Linear, Module, Parameter, _uniform


class MultiheadAttention(Module):
    """Attention over `num_heads` heads of size embed_dim // num_heads (Vaswani et al., 2017).

    Queries, keys and values are projected by in_proj_weight [3E, E] (or, when kdim or vdim
    differs from embed_dim, by q_proj_weight [E, E], k_proj_weight [E, kdim] and
    v_proj_weight [E, vdim]) plus in_proj_bias [3E], and the heads' outputs by out_proj.
    add_bias_kv and add_zero_attn are not supported."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False):
        super().__init__()
        if add_bias_kv or add_zero_attn:
            raise error(ErrorCode.ATTRIBUTE_VALUE,
                        "MultiheadAttention: add_bias_kv and add_zero_attn are not supported (give False)")
        if num_heads <= 0 or embed_dim % num_heads:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"MultiheadAttention: embed_dim {embed_dim} must be divisible by "
                        f"num_heads {num_heads}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.dropout, self.batch_first = dropout, batch_first
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        # torch's initialisation: Xavier-uniform projections, zero biases
        if self._qkv_same_embed_dim:
            self.in_proj_weight = Parameter(_xavier((3 * embed_dim, embed_dim)))
            self.q_proj_weight = self.k_proj_weight = self.v_proj_weight = None
        else:
            self.in_proj_weight = None
            self.q_proj_weight = Parameter(_xavier((embed_dim, embed_dim)))
            self.k_proj_weight = Parameter(_xavier((embed_dim, self.kdim)))
            self.v_proj_weight = Parameter(_xavier((embed_dim, self.vdim)))
        self.in_proj_bias = Parameter(zeros(3 * embed_dim)) if bias else None
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias)
        if bias:
            self.out_proj.bias = Parameter(zeros(embed_dim))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        """(output, weights): output shaped as query (embed_dim features); weights [N, L, S]
        averaged over heads, or [N, H, L, S], without N for unbatched inputs, or None when
        not `need_weights`. A bool mask is True where attention is not allowed; a float
        mask is added to the scores. `is_causal` is a hint that attn_mask is causal, as in
        torch: the mask must still be given."""
        if is_causal and attn_mask is None:
            raise error(ErrorCode.ATTRIBUTE_VALUE, "MultiheadAttention: is_causal needs attn_mask (the causal mask)")
        batched = query.ndim == 3
        q, k, v = (self._batch_major(t, batched) for t in (query, key, value))
        n, tgt, src = q.shape[0], q.shape[1], k.shape[1]
        q, k, v = (self._split_heads(t) for t in self._project(q, k, v))
        # as torch: the hint replaces the mask only where no weights are needed and no
        # padding mask must be merged into it
        causal = is_causal and key_padding_mask is None and not need_weights
        mask = None if causal else self._merged_mask(attn_mask, key_padding_mask, batched, q.dtype, (n, tgt, src))
        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            out, weights = self._attend(q, k, v, mask, p)
            weights = F.mean(weights, 1) if average_attn_weights else weights
            weights = weights if batched else F.squeeze(weights, 0)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
        out = self.out_proj(F.reshape(F.transpose(out, 1, 2), (n, tgt, self.embed_dim)))
        return self._caller_layout(out, batched), weights

    def _batch_major(self, x: Tensor, batched: bool) -> Tensor:
        """x as [N, L, E] whatever the caller's layout (an unbatched input is a batch of one)."""
        if not batched:
            return F.unsqueeze(x, 0)
        return x if self.batch_first else F.transpose(x, 0, 1)

    def _caller_layout(self, x: Tensor, batched: bool) -> Tensor:
        """The inverse of _batch_major."""
        if not batched:
            return F.squeeze(x, 0)
        return x if self.batch_first else F.transpose(x, 0, 1)

    def _project(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The input projections; rows [0, E), [E, 2E) and [2E, 3E) of the packed weight
        and bias are the query's, the key's and the value's."""
        e = self.embed_dim
        if self._qkv_same_embed_dim:
            weights = F.split(self.in_proj_weight, e, 0)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases = F.split(self.in_proj_bias, e, 0) if self.in_proj_bias is not None else (None,) * 3
        return tuple(F.linear(x, w, b) for x, w, b in zip((q, k, v), weights, biases))

    def _split_heads(self, x: Tensor) -> Tensor:
        """[N, L, E] -> [N, H, L, D]."""
        n, length, _ = x.shape
        return F.transpose(F.reshape(x, (n, length, self.num_heads, self.head_dim)), 1, 2)

    def _merged_mask(self, attn_mask, key_padding_mask, batched: bool, dtype,
                     sizes: tuple[int, int, int]) -> Tensor | None:
        """One float mask that broadcasts against the scores [N, H, L, S]: attn_mask [L, S]
        or [N*H, L, S] ([H, L, S] unbatched) and key_padding_mask [N, S] ([S] unbatched)
        summed, as torch merges them, a bool True becoming -inf. sizes: (N, L, S)."""
        n, tgt, src = sizes
        mask = None
        if attn_mask is not None:
            attn_mask = _additive(attn_mask, dtype)
            if attn_mask.ndim == 3:
                attn_mask = F.reshape(attn_mask, (n, self.num_heads, tgt, src))
            mask = attn_mask
        if key_padding_mask is not None:
            padding = _additive(key_padding_mask if batched else F.unsqueeze(key_padding_mask, 0), dtype)
            padding = F.reshape(padding, (n, 1, 1, src))
            mask = padding if mask is None else F.add(mask, padding)
        return mask

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, p: float) -> tuple[Tensor, Tensor]:
        """Attention that also returns its weights [N, H, L, S] (after dropout, as torch's)."""
        scores = F.matmul(q, F.transpose(k, -2, -1))
        scores = F.mul(scores, 1.0 / math.sqrt(self.head_dim))
        if mask is not None:
            scores = F.add(scores, mask)
        weights = F.dropout(F.softmax(scores, dim=-1), p)
        return F.matmul(weights, v), weights

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"


def _xavier(shape: tuple[int, int]) -> Tensor:
    """torch.nn.init.xavier_uniform_'s distribution for a [out, in] weight (zeros under no_init)."""
    return _uniform(shape, math.sqrt(6.0 / (shape[0] + shape[1])))


def _additive(mask, dtype) -> Tensor:
    """A mask to add to scores of `dtype`: a bool True (not allowed) becomes -inf, False 0."""
    mask = F.as_tensor(mask)
    return F.masked_fill(zeros_like(mask, dtype=dtype), mask, float("-inf")) if mask.dtype is bool_ else mask
