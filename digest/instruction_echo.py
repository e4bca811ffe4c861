"""Whether a summary recites its instructions instead of the paper.

A small model sometimes answers the task by restating it: "In three or four sentences, explain
what problem the paper addresses ..." or "for a technical reader outside the field". Such a
sentence says nothing about the paper. A sentence that shares a run of ECHO_WORDS words with the
instructions the model was given (the system text and the task), where the paper's own text does
not hold that run, is a recital: the digest drops it from the published summary, and the quality
benchmark counts the summaries that still hold one (issue 19)."""

from __future__ import annotations

import re
from functools import lru_cache

from digest.summary_text import split_sentences

# Four words in a row, where the paper lacks them: on 200 summaries of real papers every such
# run was instruction talk ("In three or four sentences, explain what this means ...", "the main
# result and why it matters"); five words missed the recitals that change one word ("three or
# four sentences" for the task's "three or four plain sentences").
ECHO_WORDS = 4

_WORD = re.compile(r"[a-z0-9]+")


# The instructions are the same for every summary, and a paper's text for its sentences.
@lru_cache(maxsize=8)
def _runs(text: str) -> frozenset[tuple[str, ...]]:
    words = _WORD.findall(text.lower())
    return frozenset(tuple(words[i : i + ECHO_WORDS]) for i in range(len(words) - ECHO_WORDS + 1))


def recited(sentence: str, instructions: str, source: str) -> str | None:
    """The first run of ECHO_WORDS words of `sentence` that `instructions` holds and `source`
    (the paper as the model saw it) does not, joined by spaces; else None."""
    words = _WORD.findall(sentence.lower())
    told = _runs(instructions)
    for i in range(len(words) - ECHO_WORDS + 1):
        run = tuple(words[i : i + ECHO_WORDS])
        if run in told and run not in _runs(source):
            return " ".join(run)
    return None


def recitals(text: str, instructions: str, source: str) -> list[str]:
    """The runs of `text`'s sentences that recite the instructions, one per such sentence."""
    found = (recited(s, instructions, source) for s in split_sentences(text))
    return [run for run in found if run]


def drop_recitals(text: str, instructions: str, source: str) -> str:
    """`text` without its sentences that recite the instructions. A text that is nothing but a
    recital is returned as it is: the faithful way to publish it is unchanged (and counted)."""
    sentences = split_sentences(text)
    kept = [s for s in sentences if recited(s, instructions, source) is None]
    return " ".join(kept) if kept else text
