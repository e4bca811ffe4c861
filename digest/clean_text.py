"""Text the digest can store and publish: without the characters XML 1.0 cannot carry.

One such character in a title made the Atom feed (which carries two weeks of digests) invalid,
and a NUL failed the whole night on PostgreSQL, whose text columns reject it. So text is cleaned
where it enters: papers from every source (`sources.load_papers`), full texts, and what a model
returns (the chat client's replies and errors, and the strings of a parsed review, where a JSON
escape such as \\u0001 brings the character back)."""

from __future__ import annotations

import re
from dataclasses import replace

from digest.paper import Paper

# XML 1.0 Char: #x9 | #xA | #xD | [#x20-#xD7FF] | [#xE000-#xFFFD] | [#x10000-#x10FFFF].
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_safe(text: str) -> str:
    """`text` without the characters XML 1.0 forbids (NUL and the other C0 controls except tab,
    newline and carriage return; lone surrogates; U+FFFE and U+FFFF)."""
    return _NOT_XML.sub("", text)


def clean_paper(paper: Paper) -> Paper:
    return replace(
        paper,
        title=xml_safe(paper.title),
        abstract=xml_safe(paper.abstract),
        authors=[xml_safe(name) for name in paper.authors],
        categories=[xml_safe(name) for name in paper.categories],
    )
