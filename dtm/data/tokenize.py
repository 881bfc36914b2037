"""Tokenizers for `dtm.data.ingest` that need no vocabulary file: bytes in, 1-D tokens out.

- `byte_tokens`: each byte is a token (vocabulary 256), as a byte-level model reads text.
- `word_tokens`: words and punctuation, each hashed (CRC32) into a vocabulary of 50,257 ids
  (GPT-2's size), uint16; a stand-in for a BPE tokenizer that costs Python work per token,
  the CPU-bound case parallel ingest is for.
"""

from __future__ import annotations

import re
import zlib

import numpy as np

VOCAB = 50257
_WORD = re.compile(rb"\w+|[^\w\s]")


def byte_tokens(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8).copy()


def word_tokens(data: bytes) -> np.ndarray:
    crc = zlib.crc32
    return np.fromiter((crc(w) % VOCAB for w in _WORD.findall(data)), np.uint16)
