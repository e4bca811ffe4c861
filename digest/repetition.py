"""Whether a model's text loops: the same sentence twice, or a long run of words said again.

A small model decoding greedily falls into loops ("The paper proposes X. The paper proposes X.")
that fill the reply up to max_tokens. The digest asks once more, with stronger penalties, when a
summary loops (pipeline), and the quality benchmark counts the summaries that still do."""

from __future__ import annotations

import re

# A run of this many words said twice is a loop, not a shared phrase: ordinary prose repeats
# 3-4 word terms ("large language models") but rarely eight words in a row.
NGRAM_WORDS = 8
MIN_SENTENCE_WORDS = 4  # "Results follow." twice is not a loop worth a retry

_WORD = re.compile(r"[a-z0-9]+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def repeated_sentence(text: str) -> str | None:
    """The first sentence (of at least MIN_SENTENCE_WORDS words) that occurs twice, else None."""
    seen: set[tuple[str, ...]] = set()
    for sentence in _SENTENCE_END.split(text):
        words = tuple(_words(sentence))
        if len(words) < MIN_SENTENCE_WORDS:
            continue
        if words in seen:
            return sentence.strip()
        seen.add(words)
    return None


def repeated_run(text: str, n: int = NGRAM_WORDS) -> str | None:
    """The first run of `n` words that occurs again later without overlapping itself."""
    words = _words(text)
    first: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - n + 1):
        gram = tuple(words[i : i + n])
        start = first.setdefault(gram, i)
        if i - start >= n:
            return " ".join(gram)
    return None


def loops(text: str) -> bool:
    return repeated_sentence(text) is not None or repeated_run(text) is not None
