"""GPT-2 weights under DTM's names written as a GGUF file of llama.cpp's `gpt2` architecture.

benchmarks/gpt2.py --peer llamacpp runs llama.cpp on the same random weights as DTM and torch:
`write_gguf` turns them into the tensors llama.cpp loads for GPT-2 (its convert_hf_to_gguf.py
names and layouts), f32 or quantized by the gguf package's own numpy quantizer.

Layouts: DTM keeps every matmul weight as Linear's [out, in], which is what GGUF stores (numpy
shape [out, in], ggml ne = [in, out]); HF's Conv1D keeps [in, out], and llama.cpp's converter
transposes it. The one difference is the fused c_attn: DTM orders its rows head by head, GGUF
as HF does, [q of all heads | k | v] (dtm.models.gpt2.hf_layout converts).

llama.cpp needs a tokenizer even when it is fed token ids: a synthetic GPT-2 vocabulary is
written (the 256 byte symbols of GPT-2's byte-level BPE, which llama.cpp looks up when it
tokenizes "\\n" at load, one merge, filler tokens, "<|endoftext|>" last).
"""

from __future__ import annotations

import gguf
import numpy as np

from dtm.models.gpt2 import GPT2Config, hf_layout

ARCH = "gpt2"
QTYPES = {"f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
          "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
          "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0)}
# DTM name (the part after "h.{i}." for a block's) -> GGUF name
GLOBAL_NAMES = {"wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight",
                "ln_f.weight": "output_norm.weight", "ln_f.bias": "output_norm.bias"}
BLOCK_NAMES = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
               "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
# Quantized when dtype is not f32: the weights that are matrix products' operands (the token
# table is also the tied output head), as convert_hf_to_gguf.py does; the position table is
# only read by rows, and it keeps it f32 like the norms and biases.
MATMUL_WEIGHTS = ("token_embd.weight", ".attn_qkv.weight", ".attn_output.weight", ".ffn_up.weight",
                  ".ffn_down.weight")


def gguf_name(name: str) -> str:
    """The GGUF tensor name of DTM weight `name` ("h.3.mlp.c_fc.weight" -> "blk.3.ffn_up.weight")."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    _, layer, rest = name.split(".", 2)
    module, _, attr = rest.rpartition(".")
    return f"blk.{layer}.{BLOCK_NAMES[module]}.{attr}"


def gguf_layout(name: str, w: np.ndarray, n_head: int) -> np.ndarray:
    """DTM weight `name` as GGUF stores it: c_attn's rows in HF's [q | k | v] order (hf_layout
    also transposes the weight to Conv1D's [in, out]; GGUF keeps [out, in]), the rest as is."""
    if ".c_attn." not in name:
        return w
    hf = hf_layout(name, w, n_head)
    return np.ascontiguousarray(hf.T) if hf.ndim == 2 else hf


def byte_symbols() -> list[str]:
    """The 256 one-character symbols of GPT-2's byte-level BPE, in byte order: a printable
    Latin-1 byte stands for itself, the k-th other byte for chr(256 + k)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    out, k = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + k))
            k += 1
    return out


def add_vocab(writer: gguf.GGUFWriter, n_vocab: int) -> None:
    """A synthetic GPT-2 tokenizer of `n_vocab` distinct tokens (llama.cpp asserts they are
    distinct): the byte symbols, the merge "Ġ t" and its token, filler tokens, and
    "<|endoftext|>" as the last id and the bos/eos token, as in GPT-2."""
    symbols = byte_symbols()
    merged = symbols[ord(" ")] + "t"
    filler = [f"<|synthetic_{i}|>" for i in range(len(symbols) + 1, n_vocab - 1)]
    tokens = symbols + [merged] + filler + ["<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (n_vocab - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges([symbols[ord(" ")] + " t"])  # llama.cpp requires the merges key, non-empty
    writer.add_bos_token_id(n_vocab - 1)
    writer.add_eos_token_id(n_vocab - 1)


def write_gguf(weights: dict[str, np.ndarray], path: str, dtype: str, n_head: int = GPT2Config.n_head,
               layer_norm_epsilon: float = GPT2Config.layer_norm_epsilon) -> None:
    """Write the GPT-2 `weights` (DTM's names, as benchmarks/gpt2.py random_weights returns
    them) to `path` as GGUF, the matmul weights f32, q8_0 or q4_0 (`dtype`). `weights` is
    emptied as it is read, so that the f32 model and its converted copies are not all held at
    once. The output head is tied to token_embd: llama.cpp uses that when no output.weight is
    in the file, so none is written."""
    qtype, file_type = QTYPES[dtype]
    n_vocab, n_embd = weights["wte.weight"].shape
    writer = gguf.GGUFWriter(path, ARCH)
    writer.add_context_length(weights["wpe.weight"].shape[0])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(weights["h.0.mlp.c_fc.weight"].shape[0])
    writer.add_block_count(sum(name.endswith(".ln_1.weight") for name in weights))
    writer.add_head_count(n_head)
    writer.add_layer_norm_eps(layer_norm_epsilon)
    writer.add_file_type(file_type)
    if dtype != "f32":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab(writer, n_vocab)
    for name in list(weights):
        target = gguf_name(name)
        w = gguf_layout(name, weights.pop(name), n_head)
        if dtype != "f32" and target.endswith(MATMUL_WEIGHTS):
            writer.add_tensor(target, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, np.ascontiguousarray(w, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
