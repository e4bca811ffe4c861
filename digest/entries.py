"""What a rendered digest is made of: one entry per paper of the day, loaded from the store.

Renderers take these plain objects, never database rows, so that `digest render` and the end of
`digest run` produce the same files from the same data."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from datetime import date, datetime
from typing import Literal

from digest.paper import Paper
from digest.review import InputBasis, ParseStatus, Review

# below_cut: ranked below --max-papers by the reader's profile; listed, never summarised.
EntryStatus = Literal["done", "failed", "pending", "below_cut"]


@dataclass(slots=True)
class DigestEntry:
    paper: Paper
    status: EntryStatus
    summary: str | None = None
    review: Review | None = None  # set when the reply validated (parse_status ok or repaired)
    review_raw: str | None = None  # the model's reply as received, kept when validation failed
    review_parse_status: ParseStatus | None = None
    input_basis: InputBasis = "abstract"
    # The full text the summary was made from (input_basis fulltext, as truncated for the
    # prompt); None: the abstract. What the faithfulness check reads (digest/faithfulness.py).
    source_text: str | None = None
    # The prompt version the summary was made with (None: the current one). What else the
    # prompt showed besides the text (authors, categories, id before 2026-12-05.4) counts too.
    prompt_version: str | None = None
    error: str | None = None  # why the paper failed, when it did
    also_in: date | None = None  # the earlier digest that first published this paper
    # With a reader profile (digest/ranking.py): the score, and why the paper is "for you".
    rank_score: float | None = None
    for_you: list[str] = field(default_factory=list)


@dataclass(slots=True)
class DailyDigest:
    digest_date: date
    model: str
    prompt_version: str
    generated_at: datetime
    entries: list[DigestEntry] = field(default_factory=list)

    @property
    def done(self) -> list[DigestEntry]:
        return [e for e in self.entries if e.status == "done"]

    @property
    def failed(self) -> list[DigestEntry]:
        return [e for e in self.entries if e.status not in ("done", "below_cut")]

    @property
    def for_you(self) -> list[DigestEntry]:
        """Done papers the reader's profile picked, best first: the page opens with them."""
        picked = [e for e in self.done if e.for_you]
        return sorted(picked, key=lambda e: -(e.rank_score or 0.0))

    @property
    def rest(self) -> list[DigestEntry]:
        """The other done papers (all of them without a profile), in listing order."""
        return [e for e in self.done if not e.for_you]

    @property
    def below_cut(self) -> list[DigestEntry]:
        """Papers ranked below --max-papers: listed with title and abstract only."""
        return [e for e in self.entries if e.status == "below_cut"]

    def fingerprint(self) -> str:
        """A hash of everything the pages show except the time: equal fingerprints, equal
        digests (a rerun that changed nothing must not look new in the feed)."""
        content = {
            "model": self.model,
            "prompt_version": self.prompt_version,
            "entries": [_fingerprinted(entry) for entry in self.entries],
        }
        text = json.dumps(content, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()


def _fingerprinted(entry: DigestEntry) -> dict:
    fields = {**asdict(entry), "review": entry.review.model_dump() if entry.review else None}
    # The model's input, not something the pages show: the summary it produced is hashed.
    del fields["source_text"], fields["prompt_version"]  # the digest's own is hashed
    # Unranked entries hash as before ranking existed: an upgrade must not re-announce them.
    if entry.rank_score is None and not entry.for_you:
        del fields["rank_score"], fields["for_you"]
    return fields
