"""The summary as published: 3-5 plain sentences. Small models ramble past the asked length and
stop mid-sentence (or mid-word) at max_tokens; keep the first five complete sentences, drop a
cut-off tail, drop a sentence said twice, and flatten paragraphs and list markers into prose.
Text that must end somewhere (a summary that is one long cut-off sentence, a reviewer's summary
cut by the schema's length bound) ends at a sentence's end or, failing that, after a whole word
with an ellipsis: never mid-word (issue 19)."""

from __future__ import annotations

import re

MAX_SENTENCES = 5
ELLIPSIS = "…"

# A sentence ends at . ! or ? followed by space and an upper-case letter, digit, quote or bracket;
# "e.g. the" and "Fig. 3" style abbreviations followed by lower case do not split.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[A-Z0-9$])")
_LIST_MARKER = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+", re.MULTILINE)
_FINISHED = (".", "!", "?")
_WORD = re.compile(r"[a-z0-9]+")
# Words too short to end on: "...as well as the…" reads as cut off anyway, but shorter.
_TRAILING_FILLER = re.compile(r"(?:[\s,;:(\-–—]+|\s+(?:a|an|the|of|and|or|to|in|for|with))+$")


def tidy_summary(text: str, cut_off: bool) -> str:
    """`cut_off`: the reply ended at max_tokens, so its last sentence may be unfinished."""
    prose = " ".join(_LIST_MARKER.sub("", text).split())
    sentences = _unique([s for s in _SENTENCE_END.split(prose) if s])
    if cut_off and sentences and not sentences[-1].endswith(_FINISHED):
        if len(sentences) > 1:
            sentences = sentences[:-1]
        else:
            sentences = [end_at_word(sentences[0])]
    return " ".join(sentences[:MAX_SENTENCES])


def finish_text(text: str) -> str:
    """`text` ending at its last complete sentence; with none, at its last whole word and an
    ellipsis. For text that a length bound may have cut (the model does not know where)."""
    text = " ".join(text.split())
    if not text or text.endswith((*_FINISHED, ELLIPSIS)):
        return text
    sentences = [s for s in _SENTENCE_END.split(text) if s]
    if len(sentences) > 1:
        return " ".join(sentences[:-1])
    return end_at_word(text)


def end_at_word(text: str) -> str:
    """Up to the last whole word (the one a cut went through is dropped), then an ellipsis."""
    head, _, _ = text.rstrip().rpartition(" ")
    head = _TRAILING_FILLER.sub("", head)
    return f"{head}{ELLIPSIS}" if head else text


def _unique(sentences: list[str]) -> list[str]:
    """Without a sentence that repeats an earlier one word for word (a looping model)."""
    seen: set[tuple[str, ...]] = set()
    kept = []
    for sentence in sentences:
        words = tuple(_WORD.findall(sentence.lower()))
        if words and words in seen:
            continue
        seen.add(words)
        kept.append(sentence)
    return kept
