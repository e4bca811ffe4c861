"""Whether a summary's checkable facts come from the paper: every number and every name in it
must appear in the text the model was given (title, and abstract or full text; before prompt
2026-12-05.4 the authors, categories and arXiv id too).

A small model "summarizes" by adding plausible numbers ("improves accuracy by 12%") and names
(a benchmark, a model family) that the paper never mentions. We cannot check prose, but numbers
and names can be looked up; a summary with one that is not in the source is marked unverified on
the page, and listed in the run report's log."""

from __future__ import annotations

import re

from digest.entries import DigestEntry
from digest.paper import Paper
from digest.prompts import PROMPT_VERSION, shows_metadata

# A token with a digit (12%, 3.5, GPT-4, Llama-3.1-8B) or a name: an acronym (BERT, LLMs), a
# mixed-case word (LoRA, ChatGPT) or a capitalized word inside a sentence (English, Transformer).
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-+/%]*[A-Za-z0-9%]|[A-Za-z0-9]")
_NUMBER = re.compile(r"^\d[\d,]*(?:\.\d+)?%?$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_PLURAL = re.compile(r"(?<=[A-Z0-9])s$")  # LLMs -> LLM
# Capitalized words a summary uses inside a sentence without naming anything from the paper.
_COMMON = frozenset({"I", "AI", "Finally", "However", "Overall", "Additionally", "Moreover"})


def checkable_tokens(text: str) -> list[str]:
    """The numbers and names of `text`, in order, each once."""
    found: list[str] = []
    for sentence in _SENTENCE_END.split(text):
        for position, match in enumerate(_TOKEN.finditer(sentence)):
            token = match.group().rstrip(".")
            if _is_checkable(token, first=position == 0) and token not in found:
                found.append(token)
    return found


def _is_checkable(token: str, *, first: bool) -> bool:
    if token in _COMMON or not token:
        return False
    if any(c.isdigit() for c in token):
        return True
    upper_inside = any(c.isupper() for c in token[1:])
    if upper_inside:  # BERT, LoRA, ChatGPT: a name wherever it stands
        return True
    # A capitalized word that starts a sentence is just the sentence's first word.
    return token[0].isupper() and not first and len(token) > 1


def unsupported(summary: str, source: str) -> list[str]:
    """The numbers and names of `summary` that `source` does not contain."""
    haystack = _normalize(source)
    return [
        t for t in checkable_tokens(summary) if not _found(t, haystack) and not _parts(t, haystack)
    ]


def _parts(token: str, haystack: str) -> bool:
    """A hyphenated word without digits whose names are each in the source: "AI-powered" (a
    common name and a plain word), "BERT-style" where the paper says BERT. With digits the
    token must be found whole: "GPT-4" is not "GPT" and a "4" somewhere."""
    pieces = token.split("-")
    if len(pieces) < 2 or any(c.isdigit() for c in token):
        return False
    names = [p for p in pieces if _is_checkable(p, first=False)]
    return all(_found(name, haystack) for name in names)


def paper_source(paper: Paper, text: str | None = None, prompt_version: str | None = None) -> str:
    """What the model was given about the paper: its title and `text` (abstract default), and
    the authors, categories and id where that prompt version showed them (current: None). A name
    the prompt did not show is not the paper's to the model, even where the paper has it."""
    body = text if text is not None else paper.abstract
    if not shows_metadata(prompt_version or PROMPT_VERSION):
        return f"{paper.title}\n{body}"
    metadata = [", ".join(paper.authors), ", ".join(paper.categories)]
    return "\n".join([paper.title, *metadata, f"arXiv: {paper.arxiv_id}v{paper.version}", body])


def _normalize(text: str) -> str:
    return " ".join(text.lower().replace(",", "").split())


def _found(token: str, haystack: str) -> bool:
    needle = token.lower().replace(",", "")
    if _NUMBER.match(token):
        # A number must stand alone: "12" is not found in "2012" or "0.125"; "12%" is "12 %".
        needle = needle.removesuffix("%")
        pattern = r"(?<![\d.])" + re.escape(needle) + r"(?![\d])"
        return re.search(pattern, haystack) is not None
    if needle in haystack:
        return True
    singular = _PLURAL.sub("", token).lower()
    return singular != needle and singular in haystack


def entry_source(entry: DigestEntry) -> str:
    """What the entry's summary was made from: the title and the abstract, or the full text
    when the summary was made from it (a fact found only in the full text is a fact)."""
    return paper_source(entry.paper, entry.source_text, entry.prompt_version)


def unverified_entries(entries: list[DigestEntry]) -> list[tuple[str, list[str]]]:
    """(paper id, facts) for each summary with numbers or names its source lacks, as the page
    marks them."""
    found = []
    for entry in entries:
        if entry.summary and (missing := unsupported(entry.summary, entry_source(entry))):
            found.append((entry.paper.arxiv_id, missing))
    return found
