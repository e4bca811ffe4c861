"""latex_to_text on LaTeX found in real arXiv abstracts and author lists, tried from outside
(issue 19): a replaced command must not glue onto the next one (`\\to\\mathbb{R}` read as an
unknown `\\toR`), arguments nest deeper than one level, font switches vanish, and math output
is not read as LaTeX a second time."""

from __future__ import annotations

import pytest

from digest.latex_text import latex_to_text


@pytest.mark.parametrize(
    ("latex", "text"),
    [
        # arXiv 2603 cs abstract: "fcolonR_(≥ 0)^KtoR_(≥ 0)" before
        (
            r"functions $f\colon\mathbb{R}_{\geq 0}^{K}\to\mathbb{R}_{\geq 0}$.",
            "functions f:R_(≥ 0)^K→R_(≥ 0).",
        ),
        (r"$\alpha\mathbf{x}$ and $a\times\mathcal{O}(1)$", "αx and a×O(1)"),
        # arXiv 2603 cs abstract: nested font commands
        (
            r"In short, \textbf{\textit{the farther the shift, the {sparser}}}.",
            "In short, the farther the shift, the sparser.",
        ),
        (r"\emph{\textit{nested {deep {deeper}}}} words", "nested deep deeper words"),
        (r"{\em emphasised} and {\bf bold} and $\bar z$", "emphasised and bold and z"),
        (r"the set $\{N, +SG\}$ of features", "the set {N, +SG} of features"),
        (r"$\frac{\sqrt{a^{2}}}{b}$", "(√(a²))/b"),
        (r"\href{https://x.org/a}{\texttt{Git{Hub}}} code", "GitHub code"),
        (r"\L{}ukasz Kaiser, Bj\o{}rn and Stra\ss{}e", "Łukasz Kaiser, Bjørn and Straße"),
        (r"\textbf{unclosed argument and a } stray", "unclosed argument and a stray"),
        (r"\begin{itemize}\item one\end{itemize}", "one"),
    ],
)
def test_latex_from_real_abstracts(latex, text):
    assert latex_to_text(latex) == text
