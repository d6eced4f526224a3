"""Tokenizers: a built-in byte-level one (zero downloads) and any Hugging Face ``tokenizers`` JSON file."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then ``<eos>`` = 256 and ``<pad>`` = 257 (vocab 258).

    >>> tok = ByteTokenizer()
    >>> tok.decode(tok.encode("héllo"))
    'héllo'
    """

    vocab_size = 258
    eos_id = 256
    pad_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A ``tokenizer.json`` file of the Hugging Face ``tokenizers`` library (``pip install tokenizers``)."""

    def __init__(self, path: str | Path, eos_token: str | None = None):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as err:
            raise RuntimeError(f"reading {path} needs the tokenizers package: pip install tokenizers") from err
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as err:  # the library raises a bare Exception for unreadable files
            raise ValueError(f"{path} is not a readable tokenizers JSON file: {err}") from err
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = [eos_token] if eos_token else ["</s>", "<|endoftext|>", "<eos>", "<｜end▁of▁sentence｜>"]
        ids = [self._tok.token_to_id(t) for t in candidates if t]
        found = [i for i in ids if i is not None]
        if not found:
            special = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special][:5]
            example = special[0] if special else "TOKEN"
            raise ValueError(
                f"{path}: no end-of-sequence token among {candidates}; name the token that ends each document "
                f"with --eos-token (recipes; DataConfig(eos_token=...) in code), e.g. --eos-token '{example}'"
                + (f" (its special tokens include {special})" if special else ""))
        self.eos_id = found[0]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(spec: str, eos_token: str | None = None) -> Tokenizer:
    """``"bytes"`` for the built-in byte tokenizer, else a path to a ``tokenizer.json`` (``eos_token``: the token
    that ends each document; default: a usual name the file has)."""
    if spec == "bytes":
        if eos_token is not None:
            raise ValueError(f"eos_token {eos_token!r} is for a tokenizer.json file; the built-in byte tokenizer "
                             "has its own <eos> (256): leave --eos-token out")
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise ValueError(f"tokenizer {spec!r} is neither 'bytes' nor an existing tokenizer.json file")
    return JsonTokenizer(spec, eos_token=eos_token)
