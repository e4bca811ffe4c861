"""The figures that say whether a night's digest is worth reading (issue 19), counted from what
the store holds and the pages show: summaries that loop or stop at the token limit, review list
items that are junk, decisions that contradict their score, and summaries with numbers or names
that the paper does not contain. `nightshift bench digest-quality` prints them."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from digest.entries import DigestEntry
from digest.faithfulness import paper_source, unsupported
from digest.instruction_echo import recitals
from digest.prompts import summary_instructions
from digest.repetition import loops
from digest.review import Review, decision_for, is_list_item, repeats_title
from digest.summary_text import without_title

_FINISHED = (".", "!", "?", ")", '"', "'")
# A label word of the prompt (or a heading of the model's own) followed by a colon: the default
# model copied the paper block's "Title:", "Authors:", "Abstract:" into its summaries (issue 19).
_LABEL = re.compile(
    r"\b(?:Title|Authors?|Categories|Abstract|arXiv|Full text|Task|Summary)\s*:", re.IGNORECASE
)
# Where a paper appeared: a small model invents one ("published in the Journal of ..."); the
# digest's inputs (arXiv preprints) never name one in a way a summary should repeat.
_VENUE = re.compile(
    r"\b(?:published (?:in|at|by)|presented at|Journal of|Proceedings of|Conference on)\b",
    re.IGNORECASE,
)


@dataclass(slots=True)
class QualityFigures:
    papers: int = 0
    done: int = 0
    failed: int = 0
    summaries: int = 0
    summaries_at_token_limit: int = 0  # the last summary call stopped at max_tokens
    summaries_looping: int = 0  # a repeated sentence or a repeated run of words
    summaries_unfinished: int = 0  # not ending at a sentence's end (cut mid-sentence or word)
    summaries_unfaithful: int = 0  # a number or name that the paper's text lacks
    summaries_with_labels: int = 0  # "Title:", "Abstract:", ... copied from a prompt
    summaries_naming_a_venue: int = 0  # "published in the Journal of ..."
    # A sentence restating the instructions ("In three or four sentences, explain ..."); counted
    # where the store's prompt version is one digest/prompts.py records.
    summaries_reciting_instructions: int = 0
    summaries_opening_with_title: int = 0  # the paper's title copied in front
    reviews: int = 0
    reviews_unparsed: int = 0
    decision_contradicts_score: int = 0
    review_summaries_unfinished: int = 0
    # The paper's title copied as the reviewer's summary (kept, or dropped to none at all).
    review_summaries_title_or_none: int = 0
    list_items: int = 0
    list_items_junk: int = 0
    # A few examples, for reading the figures rather than trusting them.
    examples: dict[str, list[str]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    def rows(self) -> list[tuple[str, int, int]]:
        """(figure, count, out of) for the table."""
        return [
            ("papers done", self.done, self.papers),
            ("summaries at the token limit", self.summaries_at_token_limit, self.summaries),
            ("summaries that loop", self.summaries_looping, self.summaries),
            ("summaries unfinished", self.summaries_unfinished, self.summaries),
            ("summaries with facts not in the paper", self.summaries_unfaithful, self.summaries),
            ("summaries with label words (Title: ...)", self.summaries_with_labels, self.summaries),
            ("summaries naming a venue", self.summaries_naming_a_venue, self.summaries),
            (
                "summaries reciting the instructions",
                self.summaries_reciting_instructions,
                self.summaries,
            ),
            ("summaries opening with the title", self.summaries_opening_with_title, self.summaries),
            ("reviews unparsed", self.reviews_unparsed, self.reviews),
            ("decisions contradicting the score", self.decision_contradicts_score, self.reviews),
            ("reviewer summaries unfinished", self.review_summaries_unfinished, self.reviews),
            (
                "reviewer summaries: the title, or none",
                self.review_summaries_title_or_none,
                self.reviews,
            ),
            ("junk review list items", self.list_items_junk, self.list_items),
        ]

    def _example(self, kind: str, text: str, limit: int = 5) -> None:
        shown = self.examples.setdefault(kind, [])
        if len(shown) < limit:
            shown.append(text[:300])


def measure(
    entries: Iterable[DigestEntry], summary_finish: dict[str, str | None], sources: dict[str, str]
) -> QualityFigures:
    """`summary_finish`: paper id -> finish reason of its last summary call (absent: unknown);
    `sources`: paper id -> the text the model was given, where it was neither the abstract
    nor the entry's own `source_text` (the full text the store loads with it)."""
    figures = QualityFigures()
    for entry in entries:
        figures.papers += 1
        pid = entry.paper.arxiv_id
        if entry.status == "done":
            figures.done += 1
        else:
            figures.failed += 1
        if entry.summary:
            _summary(figures, entry, summary_finish.get(pid), sources.get(pid))
        if entry.review is not None:
            _review(figures, entry, entry.review)
        elif entry.review_raw is not None:
            figures.reviews += 1
            figures.reviews_unparsed += 1
    return figures


def _summary(
    figures: QualityFigures, entry: DigestEntry, finish: str | None, text: str | None
) -> None:
    pid, summary = entry.paper.arxiv_id, entry.summary or ""
    figures.summaries += 1
    if finish == "length":
        figures.summaries_at_token_limit += 1
    if loops(summary):
        figures.summaries_looping += 1
        figures._example("looping", f"{pid}: {summary}")
    if not summary.rstrip().endswith(_FINISHED):
        figures.summaries_unfinished += 1
        figures._example("unfinished", f"{pid}: ...{summary[-80:]}")
    source = paper_source(entry.paper, text or entry.source_text, entry.prompt_version)
    missing = unsupported(summary, source)
    if missing:
        figures.summaries_unfaithful += 1
        figures._example("unfaithful", f"{pid}: {', '.join(missing)}")
    if labels := _LABEL.findall(summary):
        figures.summaries_with_labels += 1
        figures._example("labels", f"{pid}: {', '.join(labels)}")
    if venue := _VENUE.search(summary):
        figures.summaries_naming_a_venue += 1
        figures._example("venue", f"{pid}: ...{summary[venue.start() : venue.end() + 40]}")
    if without_title(summary, entry.paper.title) != summary:
        figures.summaries_opening_with_title += 1
        figures._example("title_first", f"{pid}: {summary[:120]}")
    instructions = summary_instructions(entry.prompt_version) if entry.prompt_version else None
    if instructions and (runs := recitals(summary, instructions, source)):
        figures.summaries_reciting_instructions += 1
        figures._example("recital", f"{pid}: {' / '.join(runs)}")


def _review(figures: QualityFigures, entry: DigestEntry, review: Review) -> None:
    pid = entry.paper.arxiv_id
    figures.reviews += 1
    if review.decision != decision_for(review.overall):
        figures.decision_contradicts_score += 1
        figures._example("contradiction", f"{pid}: {review.overall}/10 {review.decision}")
    if not review.summary.strip() or repeats_title(review.summary, entry.paper.title):
        figures.review_summaries_title_or_none += 1
        figures._example("review_summary_title", f"{pid}: {review.summary!r}")
    elif not review.summary.rstrip().endswith(_FINISHED):
        figures.review_summaries_unfinished += 1
        figures._example("review_summary_unfinished", f"{pid}: ...{review.summary[-80:]}")
    for items in (review.strengths, review.weaknesses, review.questions, review.limitations):
        for item in items:
            figures.list_items += 1
            if not is_list_item(item):
                figures.list_items_junk += 1
                figures._example("junk_item", f"{pid}: {item!r}", limit=10)
