"""Tokenizers: text to token ids and back. Byte-level today: UTF-8 bytes as tokens 0..255."""

import numpy as np

BYTE_VOCAB = 256


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255: no vocabulary file, works on any text."""

    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
