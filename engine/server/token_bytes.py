"""The raw UTF-8 bytes of one token, for the `bytes` of OpenAI's chat logprobs.

A token may hold part of a character ("日" is three bytes, often two tokens). Decoding it alone
gives U+FFFD, whose bytes tell nothing; OpenAI sends the token's own bytes so that a client can
join them. Byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM2, Qwen) spell each byte as one
printable character (GPT-2's bytes_to_unicode table), and byte-fallback SentencePiece ones have
<0xHH> tokens: both map back exactly. Anything else falls back to the decoded text's bytes."""

from __future__ import annotations

import functools
import json
import re

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable bytes stand for themselves, the rest for chr(256 + i)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


class TokenBytes:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._cached = functools.lru_cache(maxsize=65536)(self._bytes)

    def __call__(self, token_id: int) -> list[int]:
        return list(self._cached(token_id))

    def _bytes(self, token_id: int) -> bytes:
        if self._tokenizer is None:
            return str(token_id).encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        return self._tokenizer.decode([token_id]).encode()


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    return "ByteLevel" in kinds
