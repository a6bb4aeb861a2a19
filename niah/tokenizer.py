"""A byte-level tokenizer for random-weight models (tests, speed and memory runs).

It offers the small part of the Hugging Face tokenizer interface that ``niah`` uses:
``encode``, ``decode``, ``bos_token_id``, ``eos_token_id``.  Ids 0-255 are bytes; 256 is BOS, 257 EOS.
"""

from __future__ import annotations


class ByteTokenizer:
    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in (int(t) for t in ids) if i < 256)
        return data.decode("utf-8", errors="replace")
