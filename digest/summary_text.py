"""The summary as published: 3-5 plain sentences. Small models ramble past the asked length and
stop mid-sentence at max_tokens; keep the first five complete sentences, drop a cut-off tail, and
flatten paragraphs and list markers into prose."""

from __future__ import annotations

import re

MAX_SENTENCES = 5

# A sentence ends at . ! or ? followed by space and an upper-case letter, digit, quote or bracket;
# "e.g. the" and "Fig. 3" style abbreviations followed by lower case do not split.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[A-Z0-9$])")
_LIST_MARKER = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+", re.MULTILINE)


def tidy_summary(text: str, cut_off: bool) -> str:
    """`cut_off`: the reply ended at max_tokens, so its last sentence may be unfinished."""
    prose = " ".join(_LIST_MARKER.sub("", text).split())
    sentences = [s for s in _SENTENCE_END.split(prose) if s]
    if cut_off and len(sentences) > 1 and not sentences[-1].endswith((".", "!", "?")):
        sentences = sentences[:-1]
    return " ".join(sentences[:MAX_SENTENCES])
