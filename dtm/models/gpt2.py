"""GPT-2, in the shape of nanoGPT's model.py: the paper's model on one page.

`GPT2.from_pretrained(dir)` reads a Hugging Face checkpoint directory (config.json and
model.safetensors, HF names, Conv1D weights stored [in, out] and transposed here, lm_head
tied to wte). `generate` decodes with a per-layer key/value cache.

One layout differs from HF's inside the model: the rows of the fused q, k, v projection
`c_attn` are stored head by head ([q, k, v] of head 0, then of head 1, ...) where HF stores
[q of all heads | k | v]. A contiguous split of the rows is then a set of whole heads, so
tensor parallelism splits attention by heads, Megatron-style, with no communication inside
attention. Checkpoints keep HF's layout: `from_pretrained` and `hf_state_dict` convert.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

from .. import functional as F
from .. import nn
from .. import quant as quant_lib
from ..errors import DTMError, ErrorCode
from ..nn import functional as NF
from ..nn.weights import SafetensorsFile
from ..tensor import Tensor, arange, from_numpy, jit, manual_seed, no_grad, rand, randn, tensor, zeros
from .sampling import check_sampling, sample, warp_logits


# Weights HF keeps in Conv1D layout, [in, out]: transposed to and from Linear's [out, in].
_CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
_QKV = ("attn.c_attn.weight", "attn.c_attn.bias")  # rows reordered head by head (module docstring)
# greedy decoding runs at most this many tokens per call of the runtime (Plan.repeat): a
# Ctrl-C or a progress line waits for no more than that
REPEAT = 16


def from_hf_layout(name: str, w: np.ndarray, n_head: int) -> np.ndarray:
    """The weight `name` (without "transformer.") as this model stores it, from HF's layout."""
    if name.endswith(_CONV1D):
        w = w.T
    if name.endswith(_QKV):  # rows [3, n_head, head_dim] -> [n_head, 3, head_dim]
        w = w.reshape(3, n_head, -1, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)
    return np.ascontiguousarray(w)


def hf_layout(name: str, w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of from_hf_layout: a weight (or its gradient) of this model as HF stores it."""
    if name.endswith(_QKV):  # rows [n_head, 3, head_dim] -> [3, n_head, head_dim]
        w = w.reshape(n_head, 3, -1, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)
    if name.endswith(_CONV1D):
        w = w.T
    return np.ascontiguousarray(w)


def _left_padding(attention_mask, shape: tuple[int, int]) -> np.ndarray | None:
    """The number of padding tokens at the start of each row of `attention_mask` [B, T], or
    None when no row has any (the unpadded decoding plan then runs)."""
    if attention_mask is None:
        return None
    mask = np.asarray(attention_mask.numpy() if isinstance(attention_mask, Tensor) else attention_mask)
    if mask.ndim == 1:
        mask = mask[None]
    if mask.shape != shape:
        raise DTMError(ErrorCode.SHAPE_MISMATCH, f"GPT2.generate: attention_mask of shape {mask.shape} for "
                       f"prompts of shape {shape}")
    mask = mask != 0
    pad = (~mask).cumprod(axis=1).sum(axis=1)
    if (pad == shape[1]).any() or (mask.sum(axis=1) != shape[1] - pad).any():
        raise DTMError(ErrorCode.ATTRIBUTE_VALUE, "GPT2.generate: attention_mask must pad on the left only (zeros "
                       "before the first one, none after) and leave every row at least one token")
    return pad.astype(np.int64) if pad.any() else None


@dataclass
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    dropout: float = 0.0

    @classmethod
    def from_hf(cls, cfg: dict) -> "GPT2Config":
        known = {f.name for f in fields(cls)}
        out = cls(**{k: v for k, v in cfg.items() if k in known})
        out.dropout = cfg.get("resid_pdrop", 0.0)
        return out


class KVCache:
    """Keys and values of every layer in fixed-size buffers [B, n_head, max_len, head_dim].

    A forward pass writes its T new positions at `pos` (dynamic_update_slice) and each query
    attends to the positions up to its own, so every decode step has the same shapes: the
    position is data, not shape, and a jitted step replays one compiled plan for the whole
    generation. `pos` is a Python int in eager code and a 0-d int64 tensor when traced.

    `pad` (int64 [B], optional) is the number of left-padding tokens of each row, for a batch
    of prompts of different lengths: a row's padding is hidden from its queries and its
    positions count from its first real token, as transformers derives them from the
    attention mask."""

    def __init__(self, config: "GPT2Config", batch: int, max_len: int, pos: "int | Tensor" = 0,
                 kv: "list[Tensor] | None" = None, pad: Tensor | None = None):
        shape = (batch, config.n_head, max_len, config.n_embd // config.n_head)
        kv = kv if kv is not None else [zeros(*shape) for _ in range(2 * config.n_layer)]
        self.k, self.v = list(kv[:config.n_layer]), list(kv[config.n_layer:])
        self.max_len = max_len
        self.pos = pos
        self.pad = pad
        self.allowed: Tensor | None = None  # [T, max_len] (or [B, 1, T, max_len]) bool: query i may see key j

    def begin(self, T: int) -> Tensor:
        """Start a forward pass of T tokens: the mask of the keys each query may attend to,
        and the position of its first token as a 0-d int64 tensor."""
        if isinstance(self.pos, int) and self.pos + T > self.max_len:
            raise DTMError(ErrorCode.SHAPE_MISMATCH, f"KVCache: {self.pos + T} positions exceed its "
                           f"max_len = {self.max_len}")
        pos = self.pos if isinstance(self.pos, Tensor) else tensor(np.int64(self.pos))
        query_pos = F.add(pos, arange(T, dtype="i64"))
        keys = arange(self.max_len, dtype="i64").unsqueeze(0)
        self.allowed = F.le(keys, query_pos.unsqueeze(1))
        if self.pad is not None:
            # A padding query still sees itself: with no key at all its softmax is NaN, and
            # its key and value, NaN in the next layer, would reach real queries as 0 * NaN.
            seen = F.logical_or(F.ge(keys, self.pad.unsqueeze(1)).unsqueeze(1), F.eq(keys, query_pos.unsqueeze(1)))
            self.allowed = F.logical_and(self.allowed, seen).unsqueeze(1)  # [B, 1, T, max_len], for every head
        return pos

    def positions(self, pos: Tensor, T: int) -> Tensor:
        """Position ids [B, T] of a padded batch: a token's index less its row's padding, 0 on
        the padding itself (transformers: the attention mask's cumsum - 1, masked to 0)."""
        index = F.add(pos, arange(T, dtype="i64")).unsqueeze(0)
        return F.clamp(F.sub(index, self.pad.unsqueeze(1)), min=0)

    def write(self, layer: int, k: Tensor, v: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        self.k[layer] = F.dynamic_update_slice(self.k[layer], k, pos, dim=2)
        self.v[layer] = F.dynamic_update_slice(self.v[layer], v, pos, dim=2)
        return self.k[layer], self.v[layer]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v of each head, head by head
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout  # on the attention weights too (HF's attn_pdrop), in training

    def forward(self, x: Tensor, cache: KVCache | None = None, layer: int = 0, pos: Tensor | None = None) -> Tensor:
        B, T, C = x.shape
        # [B, T, 3C] -> [B, T, n_head, 3, head_dim] -> q, k, v each [B, n_head, T, head_dim]; a
        # split of c_attn's rows is a split of the heads dim, and attention runs on it in place
        qkv = self.c_attn(x).view(B, T, self.n_head, 3, C // self.n_head)
        q, k, v = (t.squeeze(3).transpose(1, 2) for t in F.split(qkv, 1, dim=3))
        if cache is None:
            y = NF.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                dropout_p=self.dropout if self.training else 0.0)
        else:
            k, v = cache.write(layer, k, v, pos)
            y = NF.scaled_dot_product_attention(q, k, v, attn_mask=cache.allowed)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cache: KVCache | None = None, layer: int = 0, pos: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, pos)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config, init: bool = True):
        super().__init__()
        self.config = config
        with nn.no_init():  # every weight is set below or by the caller (from_pretrained)
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.n_positions, config.n_embd)
            self.drop = nn.Dropout(config.dropout)
            self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
            self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        if init:
            self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p._set_value(np.zeros(p.shape, np.float32))
            elif name.startswith("ln_f") or ".ln_" in name:
                p._set_value(np.ones(p.shape, np.float32))
            else:
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj.weight") else 0.02
                p._set_value((randn(*p.shape) * std).numpy())

    def forward(self, ids, cache: KVCache | None = None) -> Tensor:
        """ids: int64 [B, T] -> logits [B, T, vocab_size]."""
        ids = ids if isinstance(ids, Tensor) else tensor(np.asarray(ids, dtype=np.int64))
        B, T = ids.shape
        start = cache.pos if cache is not None else 0
        if isinstance(start, int) and start + T > self.config.n_positions:
            raise DTMError(ErrorCode.SHAPE_MISMATCH, f"GPT2: {start + T} positions exceed n_positions = "
                           f"{self.config.n_positions}")
        if cache is None:
            pos, pos_emb = None, self.wpe(arange(T, dtype="i64"))
        else:
            pos = cache.begin(T)
            if cache.pad is None and nn.is_narrow(self.wpe.weight):  # a narrow table is read by rows
                pos_emb = self.wpe(F.add(pos, arange(T, dtype="i64")))
            elif cache.pad is None:
                pos_emb = F.dynamic_slice(self.wpe.weight, pos, dim=0, size=T)
            else:
                pos_emb = self.wpe(cache.positions(pos, T))
        x = self.drop(self.wte(ids) + pos_emb)
        for i, block in enumerate(self.h):
            x = block(x, cache, i, pos)
        if cache is not None:
            cache.pos = cache.pos + T
        x = self.ln_f(x)
        head = self.wte.weight  # lm_head shares wte's weights; a narrow one is read narrow by the product
        return F.matmul(x, (F.cast(head, x.dtype) if nn.is_narrow(head) else head).transpose(0, 1))

    def quantize_(self, dtype) -> None:
        """dtm.quant.quantize calls this before its Linear and Embedding modules make their
        weights narrow: the decoding steps traced with the old weights are dropped."""
        for key in [k for k in self.__dict__ if k.endswith("_step_jit")]:
            del self.__dict__[key]

    @no_grad()
    def generate(self, ids, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: "int | Sequence[int] | None" = None, pad_token_id: int | None = None,
                 attention_mask=None, generator: "np.random.Generator | int | None" = None,
                 progress: bool = False) -> Tensor:
        """The prompts [B, T] followed by up to `max_new_tokens` tokens each, as transformers'
        `generate` gives them: greedy unless `do_sample`; sampling applies `temperature`, then
        `top_k`, then `top_p` (dtm.models.sampling; top_k None keeps every token, where
        transformers' default is 50). `generator` (a numpy Generator or a seed) draws the
        samples; without one they come from DTM's generator (dtm.manual_seed).

        `attention_mask` [B, T] (1 for a token, 0 for padding) gives a batch of prompts of
        different lengths, padded on the left. With `eos_token_id` (one id or several), a row
        that produced one is finished: it gets `pad_token_id` (by default the first eos id)
        from then on, and decoding stops when every row is finished."""
        ids = np.asarray(ids.numpy() if isinstance(ids, Tensor) else ids, dtype=np.int64)
        if ids.ndim == 1:
            ids = ids[None]
        B, T = ids.shape
        total = T + max_new_tokens
        if total > self.config.n_positions:
            raise DTMError(ErrorCode.SHAPE_MISMATCH, f"GPT2.generate: {T} prompt + {max_new_tokens} new tokens "
                           f"exceed n_positions = {self.config.n_positions}")
        if do_sample:
            check_sampling(temperature, top_k, top_p)
        pad = _left_padding(attention_mask, ids.shape)
        eos = None if eos_token_id is None else np.atleast_1d(np.asarray(eos_token_id, dtype=np.int64))
        if eos is not None and pad_token_id is None:
            pad_token_id = int(eos[0])  # as transformers does when only eos is given
        rng = generator if generator is None or isinstance(generator, np.random.Generator) \
            else np.random.default_rng(generator)
        # Cache lengths round up to a multiple of 64 so later calls reuse the compiled steps.
        max_len = min(self.config.n_positions, -(-total // 64) * 64)
        kv = [zeros(B, self.config.n_head, max_len, self.config.n_embd // self.config.n_head)
              for _ in range(2 * self.config.n_layer)]
        # greedy decoding takes each row's argmax inside the step: one plan a token, not two
        step = self._jitted_step(padded=pad is not None, greedy=not do_sample)
        extra = () if pad is None else (tensor(pad),)
        out = [ids]
        unfinished = np.ones(B, dtype=bool)
        step_input, pos = ids, 0
        # greedy and unpadded: after the prompt's step, runs of up to REPEAT tokens are each one
        # call of the runtime (jit._repeat), each token's ids fed to the next step there, and
        # rows that produced an eos id padded there
        loop = not do_sample and pad is None
        i = 0
        while i < max_new_tokens:
            got = None
            if loop and i > 0:
                alive = unfinished.astype(np.uint8)
                got = step._repeat(min(REPEAT, max_new_tokens - i),
                                   (from_numpy(np.array(step_input)), from_numpy(np.array(pos, np.int64)), *kv),
                                   feed=(0, 0), advance=(1, 1), stop=None if eos is None else (eos, pad_token_id, alive))
                loop = got is not None  # (a backend that cannot: a token a time)
            if got is not None:
                (_, *kv), ran = got
                unfinished = alive.astype(bool)
            else:
                last, *kv = step(from_numpy(step_input), from_numpy(np.array(pos, np.int64)), *extra, *kv)
                if do_sample:
                    u = rng.random(B) if rng is not None else rand(B, dtype="f64").numpy()
                    nxt = sample(warp_logits(last.numpy(), temperature, top_k, top_p), u)
                else:
                    nxt = last.numpy()
                if eos is not None:
                    nxt = np.where(unfinished[:, None], nxt, np.int64(pad_token_id))
                    unfinished &= ~np.isin(nxt[:, 0], eos)
                ran = [nxt]
            out.extend(ran)
            pos += step_input.shape[1] * len(ran)
            step_input, i = ran[-1], i + len(ran)
            if progress:
                print(f"\rgenerating: {i}/{max_new_tokens} tokens", end="", file=sys.stderr, flush=True)
            if not unfinished.any():
                break
        if progress:
            print(file=sys.stderr)
        return tensor(np.concatenate(out, axis=1))

    def _jitted_step(self, padded: bool, greedy: bool) -> jit:
        """One decoding step, (ids [B, T], pos, *cache) -> (last logits, *new cache), jitted:
        traced once per (T, cache length) and replayed for every later step. `padded`: for a
        left-padded batch, (ids, pos, pad [B], *cache), a plan of its own so that the unpadded
        step keeps its cheaper mask and position slice. `greedy`: the last logits' argmax
        [B, 1] in their place (the argmax as a second plan cost 0.6 ms of a 24 ms token)."""
        key = ("_greedy" if greedy else "") + ("_padded" if padded else "") + "_step_jit"
        if self.__dict__.get(key) is None:
            def step(ids: Tensor, pos: Tensor, *rest: Tensor):
                pad, kv = (rest[0], rest[1:]) if padded else (None, rest)
                cache = KVCache(self.config, ids.shape[0], kv[0].shape[2], pos, list(kv), pad)
                logits = self(ids, cache)[:, -1, :]
                return (F.argmax(logits, dim=-1, keepdim=True) if greedy else logits, *cache.k, *cache.v)

            first = 3 if padded else 2  # (ids, pos[, pad], *kv): the caches are donated, updated in place
            self.__dict__[key] = jit(step, donate=range(first, first + 2 * self.config.n_layer))
        return self.__dict__[key]

    def hf_state_dict(self) -> dict[str, np.ndarray]:
        """This model's weights under HF GPT2LMHeadModel's names and layouts (Conv1D weights
        as [in, out], c_attn's rows as [q | k | v], lm_head tied to wte): the inverse of
        from_pretrained."""
        out = {"transformer." + name: hf_layout(name, t.numpy(), self.config.n_head)
               for name, t in self.state_dict().items()}
        out["lm_head.weight"] = out["transformer.wte.weight"]
        return out

    def hf_config(self) -> dict:
        """This model's config.json as transformers writes GPT-2's (a checkpoint records it:
        `dtm checkpoint export` then writes the model as transformers reads it)."""
        c = self.config
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": c.vocab_size,
                "n_positions": c.n_positions, "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head,
                "layer_norm_epsilon": c.layer_norm_epsilon, "resid_pdrop": c.dropout, "embd_pdrop": c.dropout,
                "attn_pdrop": c.dropout, "activation_function": "gelu_new"}

    def save_pretrained(self, path: str) -> None:
        """Write an HF GPT-2 checkpoint directory (config.json, model.safetensors)."""
        os.makedirs(path, exist_ok=True)
        c = self.config
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.hf_config(), f, indent=2)
        # narrow weights (dtm.quant) keep this model's layout: blocks cannot be transposed
        state, narrow = {}, {}
        for name, t in self.state_dict().items():
            if nn.is_narrow(t):
                narrow["transformer." + name] = (t.numpy(), t.dtype, t.shape)
            else:
                state["transformer." + name] = hf_layout(name, t.numpy(), c.n_head)
        arrays, listed = quant_lib.pack(narrow)
        nn.save_safetensors({**state, **arrays}, os.path.join(path, "model.safetensors"),
                            metadata={"format": "pt", **listed})

    @classmethod
    def from_pretrained(cls, path: str, quant: str | None = None) -> "GPT2":
        """Load a Hugging Face GPT-2 checkpoint directory (config.json, model.safetensors).
        `quant` ("q8_0", "q4_0", "bf16"): the Linear and Embedding weights are made narrow
        as they are read, tensor by tensor (the token table in row blocks), so the f32
        model is never in memory: as `dtm.quant.quantize` on the loaded model, without its
        peak. A checkpoint saved from a narrow model loads narrow as it is."""
        with open(os.path.join(path, "config.json")) as f:
            config = GPT2Config.from_hf(json.load(f))
        dt = None if quant is None else quant_lib.narrow_dtype(quant)
        model = cls(config, init=False)  # zeros no page holds yet: each weight replaces its own
        modules = dict(model.named_modules())
        state = {}
        with SafetensorsFile(os.path.join(path, "model.safetensors")) as f:
            narrow = quant_lib.unpack(f.metadata)  # written by save_pretrained of a dtm.quant model
            for hf_name in f.names:
                name = hf_name.removeprefix("transformer.")
                if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
                    continue  # causal-mask buffers; the head is tied to wte
                owner, _, attr = name.rpartition(".")
                listed = narrow.get(hf_name)
                if listed is not None:  # stored narrow, in this model's layout
                    if owner not in modules or attr != "weight":
                        raise DTMError(ErrorCode.QUANTIZED_MISUSE, f"GPT2.from_pretrained: {name} is stored "
                                       f"{listed[0]}, but only Linear and Embedding weights can be")
                    weight = nn.narrow_parameter(f.read(hf_name), *listed)
                elif dt is not None and attr == "weight" and hasattr(modules.get(owner), "quantize_"):
                    weight = nn.narrow_parameter(_narrow_from(f, hf_name, name, dt, config.n_head), dt,
                                                 _model_shape(f.shape(hf_name), name))
                else:
                    state[name] = Tensor.from_numpy(from_hf_layout(name, f.read(hf_name), config.n_head))
                    continue
                setattr(modules[owner], attr, weight)
                state[name] = weight
        model.load_state_dict(state)
        return model.eval()


def _model_shape(hf_shape: tuple[int, ...], name: str) -> tuple[int, ...]:
    return hf_shape[::-1] if name.endswith(_CONV1D) else hf_shape


def _narrow_from(f: SafetensorsFile, hf_name: str, name: str, dt, n_head: int) -> np.ndarray:
    """The narrow storage of weight `name` from the file: a Conv1D weight is read whole first
    (it is transposed: 9 MiB at most in GPT-2), any other is mapped, and quantize_weight
    converts it in blocks of rows, giving each block's pages back once converted."""
    x = from_hf_layout(name, f.read(hf_name), n_head) if name.endswith(_CONV1D) else f.map(hf_name)
    return quant_lib.quantize_weight(x, dt, name)


__all__ = ["GPT2", "GPT2Config", "KVCache", "from_hf_layout", "hf_layout", "manual_seed"]
