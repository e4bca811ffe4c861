"""The summary as published: 3-5 plain sentences. Small models ramble past the asked length and
stop mid-sentence (or mid-word) at max_tokens; keep the first five complete sentences, drop a
cut-off tail, drop a sentence said twice or one that loops, drop the paper's title copied in
front, and flatten paragraphs and list markers into prose.
Text that must end somewhere (a summary that is one long cut-off sentence, a reviewer's summary
cut by the schema's length bound) ends at a sentence's end or, failing that, after a whole word
with an ellipsis: never mid-word (issue 19)."""

from __future__ import annotations

import re

from digest.repetition import NGRAM_WORDS

MAX_SENTENCES = 5
ELLIPSIS = "…"

# A sentence ends at . ! or ? followed by space and an upper-case letter, digit, quote or bracket;
# "e.g. the" and "Fig. 3" style abbreviations followed by lower case do not split.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[A-Z0-9$])")
_LIST_MARKER = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+", re.MULTILINE)
_FINISHED = (".", "!", "?")
_WORD = re.compile(r"[a-z0-9]+")
_LETTERS = re.compile(r"[^\W_]+")
# Words too short to end on: "...as well as the…" reads as cut off anyway, but shorter.
_TRAILING_FILLER = re.compile(r"(?:[\s,;:(\-–—]+|\s+(?:a|an|the|of|and|or|to|in|for|with))+$")


def tidy_summary(text: str, cut_off: bool, title: str = "") -> str:
    """`cut_off`: the reply ended at max_tokens, so its last sentence may be unfinished.
    `title`: the paper's, dropped where the reply opens with it."""
    prose = without_title(" ".join(_LIST_MARKER.sub("", text).split()), title)
    sentences = _unique(split_sentences(prose))
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
    sentences = split_sentences(text)
    if len(sentences) > 1:
        return " ".join(sentences[:-1])
    return end_at_word(text)


def end_at_word(text: str) -> str:
    """Up to the last whole word (the one a cut went through is dropped), then an ellipsis."""
    head, _, _ = text.rstrip().rpartition(" ")
    head = _TRAILING_FILLER.sub("", head)
    return f"{head}{ELLIPSIS}" if head else text


def without_title(text: str, title: str) -> str:
    """`text` without the paper's title in front of it. The prompt opens with the title line and
    a small model copies it, often with no full stop ("LuxBorrow: From Pompier to Pompjee,
    Tracing Borrowing in Luxembourgish LuxBorrow is a ..."), sometimes with words run together
    ("via PivotWords" for "via Pivot Words"): compared letters and digits only."""
    target = letters(title)
    if not target:
        return text
    seen = ""
    for match in re.finditer(r"\S+", text):
        seen += letters(match.group())
        if seen == target:
            rest = text[match.end() :].lstrip(" .:;,-–—")
            return rest if rest else text
        if not target.startswith(seen):
            return text
    return text


def letters(text: str) -> str:
    """Its letters and digits only, lower-cased: "Comic: Agentic…" is "comicagentic"; how a
    copied title is recognised whatever the model did to its spaces and punctuation."""
    return "".join(_LETTERS.findall(text.lower()))


def split_sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text) if s]


def _unique(sentences: list[str]) -> list[str]:
    """Without a sentence that repeats an earlier one word for word, or that repeats a run of
    NGRAM_WORDS words of its own or of a kept sentence (a looping model: "they are presented
    with bold text again using bullet points again; they are presented with bold text again
    using bullet points again"). The sentences before the loop are kept."""
    seen: set[tuple[str, ...]] = set()
    runs: set[tuple[str, ...]] = set()
    kept = []
    for sentence in sentences:
        words = tuple(_WORD.findall(sentence.lower()))
        if words and words in seen:
            continue
        own = [words[i : i + NGRAM_WORDS] for i in range(len(words) - NGRAM_WORDS + 1)]
        looping = len(set(own)) < len(own) or runs.intersection(own)
        runs.update(own)  # a dropped loop said again later is a loop too
        if looping:
            continue
        seen.add(words)
        kept.append(sentence)
    return kept
