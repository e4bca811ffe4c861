"""Prompts of exactly a trace record's input length, sharing prefixes as its hash_ids say.

Each hash_id names a block of the record's block size in tokens (`TraceRecord.hash_block_size`: its
`block_size` field, else Mooncake's 512; a command's --block-size replaces it as the trace is read,
or `block_tokens` here). The tokens of block h are a deterministic function of (seed, h), so two
records with equal hash_ids at equal positions get equal token prefixes, and a server with a prefix
cache hits them as the traced server did. Blocks past the end of a record's hash_ids belong to that
record alone. Changing the seed changes every block, which keeps a second replay against the same
server from hitting the first one's cache.

- TokenPrompts: token-id prompts (for /v1/completions, which takes a list of ids). Ids are drawn
  from [LOW_ID, vocab) so that they avoid the low ids where tokenizers keep special tokens.
- TextPrompts: text for servers that take only strings. Block h is a run of words that are one
  token each in the server's tokenizer; the text is re-encoded with that tokenizer (as the server
  does, special tokens included) and words are added or dropped at the end until it has the
  exact length."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workload.trace import TraceRecord, block_size_problem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

LOW_ID = 1000  # below it tokenizers keep special and byte tokens
DEFAULT_VOCAB = 32000  # the smallest common vocabulary (Llama 2, Mistral): safe for any server
_OWN = 1  # seed namespace of a record's own blocks (0: shared hash_id blocks)
_MAX_WORDS = 4096


def _key(value: int) -> int:
    return value if value >= 0 else value + 2**64  # SeedSequence takes non-negative ints


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A local HF tokenizer folder (or tokenizer.json's folder), loaded offline."""
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        # A malformed folder fails in transformers or the Rust tokenizers in any way (KeyError,
        # TypeError, a bare Exception): for a user all of them mean "not a tokenizer".
        problem = (str(exc).splitlines() or [""])[0]
        if not isinstance(exc, OSError | ValueError):
            problem = f"{type(exc).__name__}: {problem}"
        raise ValueError(f"cannot load a tokenizer from {path}: {problem}") from None


def check_block_size(records: Sequence[TraceRecord], block_tokens: int | None = None) -> None:
    """Every record's hash_ids fit its block size (or block_tokens); ValueError otherwise."""
    for i, r in enumerate(records):
        if problem := block_size_problem(r, block_tokens):
            raise ValueError(f"record {i}: {problem}")


class _Blocks:
    """Deterministic blocks of draws from [0, n) per hash_id, cached; a block has the record's
    block size (or `block_tokens` when given), so equal hash_ids in one trace are equal tokens."""

    def __init__(self, n: int, seed: int, block_tokens: int | None = None) -> None:
        self.n, self.seed, self.block_tokens = n, seed, block_tokens
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def shared(self, h: int, size: int) -> np.ndarray:
        block = self._cache.get((h, size))
        if block is None:
            block = self._draw(size, 0, _key(h))
            self._cache[(h, size)] = block
        return block

    def own(self, index: int, position: int, size: int) -> np.ndarray:
        return self._draw(size, _OWN, index, position)

    def _draw(self, size: int, *key: int) -> np.ndarray:
        rng = np.random.default_rng([_key(self.seed), *key])
        return rng.integers(0, self.n, size, dtype=np.int64)

    def sequence(self, record: TraceRecord, index: int, length: int) -> np.ndarray:
        """`length` draws: the record's hash_id blocks, then blocks of its own."""
        size = self.block_tokens or record.hash_block_size
        parts: list[np.ndarray] = []
        have = 0
        position = 0
        while have < length:
            if position < len(record.hash_ids):
                block = self.shared(record.hash_ids[position], size)
            else:
                block = self.own(index, position, size)
            parts.append(block[: length - have])
            have += len(parts[-1])
            position += 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class TokenPrompts:
    """Token-id prompts of exactly input_length ids from [low, vocab_size)."""

    def __init__(
        self,
        vocab_size: int = DEFAULT_VOCAB,
        seed: int = 0,
        low: int = LOW_ID,
        block_tokens: int | None = None,
    ) -> None:
        if vocab_size <= low:
            raise ValueError(f"vocabulary {vocab_size} has no ids above {low}")
        self.low = low
        self.vocab_size = vocab_size
        self._blocks = _Blocks(vocab_size - low, seed, block_tokens)

    def prompt(self, index: int, record: TraceRecord) -> list[int]:
        return (self._blocks.sequence(record, index, record.input_length) + self.low).tolist()


def one_token_words(tokenizer: PreTrainedTokenizerBase, limit: int = _MAX_WORDS) -> list[str]:
    """Lower-case words that are a single token when preceded by a space, in id order."""
    words: list[str] = []
    seen: set[str] = set()
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if not re.fullmatch(r" ?[a-z]{3,12}", text):
            continue
        word = text.strip()
        if word in seen or len(tokenizer.encode(" " + word, add_special_tokens=False)) != 1:
            continue
        seen.add(word)
        words.append(word)
        if len(words) >= limit:
            break
    if len(words) < 16:
        raise ValueError("the tokenizer has too few one-token words to build text prompts")
    return words


class TextPrompts:
    """String prompts whose encoding by `tokenizer` (special tokens included, as a server's
    /v1/completions encodes them) has exactly input_length tokens, where that is possible."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        seed: int = 0,
        block_tokens: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.words = one_token_words(tokenizer)
        self._blocks = _Blocks(len(self.words), seed, block_tokens)
        self._specials = len(tokenizer.encode("", add_special_tokens=True))
        self.inexact = 0  # prompts that could not be brought to the exact length

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True))

    def prompt(self, index: int, record: TraceRecord) -> str:
        target = record.input_length
        n_words = max(0, target - self._specials)
        # A few spare words from the record's own sequence cover any shortfall.
        draws = self._blocks.sequence(record, index, n_words + 64)
        words = [self.words[i] for i in draws]
        count = n_words
        for _ in range(16):
            text = "".join(" " + w for w in words[:count])
            have = self.count(text)
            if have == target:
                return text
            count = max(0, min(len(words), count + target - have))
            if count == len(words) and have < target:
                break
        self.inexact += 1
        log.debug("record %d: prompt of %d tokens instead of %d", index, have, target)
        return text
