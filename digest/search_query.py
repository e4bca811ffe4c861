"""What a user types into `digest search` or the web view's search box, made safe for the index.

The syntax is deliberately small: words (all must match, in any field, stemmed) and "quoted
phrases" (words in that order). Nothing a user types reaches the database as query syntax: FTS5
gets every term as a quoted string (so `NEAR(`, `*`, `-`, `OR`, `col:` are plain text to its
tokenizer) and PostgreSQL gets every term through `phraseto_tsquery` as a bound parameter. A
query that has no word left to look for is a `QueryError` with a message for the user, never a
database error."""

from __future__ import annotations

import re
from dataclasses import dataclass

from digest.clean_text import xml_safe
from digest.paper import InvalidArxivId, parse_arxiv_id

MAX_QUERY_CHARS = 500
MAX_TERMS = 32

# A quoted phrase, or a run of anything else up to whitespace or a quote. An unmatched quote
# is left over by the first alternative and read as part of the words around it.
_TERM_RE = re.compile(r'"([^"]*)"|([^\s"]+)')


class QueryError(ValueError):
    """The query cannot be searched for; the message says why, for the user."""


@dataclass(slots=True, frozen=True)
class SearchTerm:
    text: str
    phrase: bool  # typed in quotes


@dataclass(slots=True, frozen=True)
class SearchQuery:
    terms: tuple[SearchTerm, ...]

    def fts5(self) -> str:
        """The FTS5 MATCH expression: every term a quoted string, all of them required."""
        return " AND ".join('"' + term.text.replace('"', '""') + '"' for term in self.terms)

    def pg_parameters(self) -> dict[str, str]:
        """Bound parameters t0, t1, ... for `pg_tsquery_sql`."""
        return {f"t{i}": term.text for i, term in enumerate(self.terms)}

    @property
    def paper_id(self) -> str | None:
        """The arXiv id the query is, in any spelling ("2603.10877v2", "arXiv:2603.10877", the
        abs URL): the paper is looked up by it, since an id is not among the indexed words."""
        if len(self.terms) != 1 or self.terms[0].phrase:
            return None
        try:
            return parse_arxiv_id(self.terms[0].text)[0]
        except InvalidArxivId:
            return None

    def pg_tsquery_sql(self, config: str) -> str:
        """A tsquery expression over the bound terms (`config` is ours, never the user's)."""
        return " && ".join(f"phraseto_tsquery('{config}', :t{i})" for i in range(len(self.terms)))


def parse_query(text: str) -> SearchQuery:
    # Control characters would fail on PostgreSQL (NUL) and cannot occur in the stored text.
    text = xml_safe(text).strip()
    if not text:
        raise QueryError("the search query is empty")
    if len(text) > MAX_QUERY_CHARS:
        raise QueryError(f"the search query is longer than {MAX_QUERY_CHARS} characters")
    terms = []
    for match in _TERM_RE.finditer(text):
        phrase, word = match.groups()
        term = " ".join((phrase if phrase is not None else word).split())
        # Punctuation alone (`*`, `-`, `(`) would be an empty phrase: nothing to look for.
        if any(ch.isalnum() for ch in term):
            terms.append(SearchTerm(term, phrase is not None))
    if not terms:
        raise QueryError(f'nothing to search for in {text!r}: use words or "a phrase"')
    if len(terms) > MAX_TERMS:
        raise QueryError(f"the search query has more than {MAX_TERMS} words or phrases")
    return SearchQuery(tuple(terms))
