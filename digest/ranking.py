"""Papers ranked by a reader's profile (digest/profile.py), best first, each with the reasons it
is "for you".

As arxiv-sanity-lite does: TF-IDF over title and abstract (words and word pairs, sublinear term
frequency, English stop words), and per tag a linear SVM trained on that tag's papers against
every other paper at hand (tonight's and the store's recent ones), heavily regularised (C=0.01)
and class-balanced, so that three liked papers are not outvoted by five hundred others; its
coordinate descent is seeded, so that a rerun ranks the same papers the same way. A paper's
score is its best tag's decision value, plus a fixed bonus per followed author and per keyword
(explicit wishes outrank a learned guess), plus, with an embeddings endpoint, the cosine
similarity to its nearest tagged paper.

A paper is "for you" when it names a followed author or a keyword, when a tag's classifier puts
it far above the untagged papers (`_stands_out`), or when its embedding is close to a tagged paper
(cosine at least `EMBEDDING_FOR_YOU`)."""

from __future__ import annotations

import logging
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from digest.paper import Paper
from digest.profile import ReaderProfile

log = logging.getLogger(__name__)

AUTHOR_BONUS = 2.0
KEYWORD_BONUS = 1.0
EMBEDDING_FOR_YOU = 0.6
FOR_YOU_Z = 3.5
# Token rule of arxiv-sanity-lite: words of two or more characters that start with a letter.
_TOKEN_PATTERN = r"(?u)\b[a-zA-Z_][a-zA-Z0-9_]+\b"

Embed = Callable[[list[str]], np.ndarray]  # texts -> one row per text


@dataclass(slots=True)
class Ranked:
    paper: Paper
    score: float
    reasons: list[str] = field(default_factory=list)  # empty: not "for you"

    @property
    def for_you(self) -> bool:
        return bool(self.reasons)


def paper_text(title: str, abstract: str) -> str:
    return f"{title}. {abstract}"


def rank_papers(
    papers: list[Paper],
    profile: ReaderProfile,
    background: list[str] | None = None,
    embed: Embed | None = None,
) -> list[Ranked]:
    """`papers` best first (ties keep their given order). `background`: texts of other papers
    (the store's recent ones), negatives and IDF statistics for the classifiers. `embed`, when
    given, adds the embedding similarity; if it raises, ranking goes on without it."""
    ranked = [Ranked(p, 0.0) for p in papers]
    if not papers:
        return ranked
    for item in ranked:
        _explicit_matches(item, profile)
    texts = [paper_text(p.title, p.abstract) for p in papers]
    scored = _tag_scores(papers, texts, profile, background or [])
    for item, (tag, value, close) in zip(ranked, scored):
        item.score += value
        if close:
            item.reasons.append(f"like your “{tag}” papers")
    if embed is not None:
        _add_embedding_scores(ranked, texts, profile, embed)
    order = sorted(range(len(ranked)), key=lambda i: (-ranked[i].score, i))
    return [ranked[i] for i in order]


def _folded(text: str) -> str:
    """Compared without case, accents or repeated spaces, as TF-IDF compares words
    (`strip_accents`): "Gaetan" typed on a plain keyboard follows arXiv's "Gaëtan"."""
    decomposed = unicodedata.normalize("NFKD", text)
    bare = "".join(c for c in decomposed if not unicodedata.combining(c))
    return " ".join(bare.casefold().split())


def _explicit_matches(item: Ranked, profile: ReaderProfile) -> None:
    names = {_folded(a) for a in item.paper.authors}
    for author in profile.authors:
        if _folded(author) in names:
            item.score += AUTHOR_BONUS
            item.reasons.append(f"by {author}")
    text = _folded(f"{item.paper.title} {item.paper.abstract}")
    for keyword in profile.keywords:
        if re.search(rf"(?<!\w){re.escape(_folded(keyword))}(?!\w)", text):
            item.score += KEYWORD_BONUS
            item.reasons.append(f"mentions “{keyword}”")


def _tag_scores(
    papers: list[Paper], texts: list[str], profile: ReaderProfile, background: list[str]
) -> list[tuple[str, float, bool]]:
    """Each paper's best tag, that tag's SVM decision value (arxiv-sanity-lite's
    recommendation) and whether the value stands out (`_stands_out`); empty without tagged
    papers."""
    tags = {tag: tagged for tag, tagged in profile.tags.items() if tagged}
    if not tags:
        return []
    from scipy.sparse import vstack
    from sklearn import svm
    from sklearn.feature_extraction.text import TfidfVectorizer

    tagged_texts = [p.text for tagged in tags.values() for p in tagged]
    corpus = texts + tagged_texts + background
    vectorizer = TfidfVectorizer(
        strip_accents="unicode",
        lowercase=True,
        stop_words="english",
        token_pattern=_TOKEN_PATTERN,
        ngram_range=(1, 2),
        max_features=20_000,
        sublinear_tf=True,
    )
    try:
        matrix = vectorizer.fit_transform(corpus)
    except ValueError:  # no word at all (empty titles and abstracts): nothing to learn from
        return []
    candidates = matrix[: len(texts)]
    others = [matrix[: len(texts)], matrix[len(texts) + len(tagged_texts) :]]
    scores: dict[str, np.ndarray] = {}
    outliers: dict[str, np.ndarray] = {}
    start = len(texts)
    for tag, tagged in tags.items():
        positives = matrix[start : start + len(tagged)]
        start += len(tagged)
        ids = {p.arxiv_id for p in tagged if p.arxiv_id}
        # A tagged paper among tonight's is no negative of its own tag.
        keep = np.array([p.arxiv_id not in ids for p in papers])
        negatives = vstack([others[0][keep], others[1]])
        if negatives.shape[0] == 0:
            continue
        x = vstack([positives, negatives])
        y = np.r_[np.ones(positives.shape[0]), np.zeros(negatives.shape[0])]
        classifier = svm.LinearSVC(
            class_weight="balanced", max_iter=10_000, tol=1e-6, C=0.01, random_state=0
        )
        classifier.fit(x, y)
        scores[tag] = classifier.decision_function(candidates)
        outliers[tag] = _stands_out(scores[tag], classifier.decision_function(negatives))
    if not scores:
        return []
    # A paper's tag score is its best tag's: a paper like two tags is not counted twice.
    names = list(scores)
    table = np.vstack([scores[name] for name in names])
    best = table.argmax(axis=0)
    return [(names[b], float(table[b, i]), bool(outliers[names[b]][i])) for i, b in enumerate(best)]


def _stands_out(values: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Which values lie far above the untagged papers' decision values: a robust z-score
    (median and scaled median absolute deviation) of at least FOR_YOU_Z. With C=0.01 the SVM's
    values are all negative and close together (-0.2 to -0.3 on 400 real cs.CL papers), so the
    sign says nothing; the distance from the crowd does. On those papers, 5 liked speech papers
    made 11 of 300 others stand out, 9 of them about speech or audio."""
    median = float(np.median(reference))
    spread = float(np.median(np.abs(reference - median))) * 1.4826
    if spread <= 0:
        return values > median
    return (values - median) / spread >= FOR_YOU_Z


def _add_embedding_scores(
    ranked: list[Ranked], texts: list[str], profile: ReaderProfile, embed: Embed
) -> None:
    tagged = [p.text for papers in profile.tags.values() for p in papers]
    if not tagged:
        return
    try:
        vectors = _unit_rows(embed(texts + tagged))
    except Exception as exc:  # the endpoint is an optional helper: rank without it
        log.warning("embeddings unavailable (%s); ranking by TF-IDF and the profile only", exc)
        return
    similarity = vectors[: len(texts)] @ vectors[len(texts) :].T
    nearest = similarity.max(axis=1)
    for item, value in zip(ranked, nearest):
        item.score += float(value)
        if value >= EMBEDDING_FOR_YOU:
            item.reasons.append(f"close to your papers (embedding similarity {value:.2f})")


def _unit_rows(matrix: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return matrix / np.where(norms == 0, 1.0, norms)
