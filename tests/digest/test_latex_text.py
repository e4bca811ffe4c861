"""latex_to_text: arXiv LaTeX as a page without a TeX renderer shows it (issue 19)."""

from __future__ import annotations

import pytest

from digest.latex_text import latex_to_text


@pytest.mark.parametrize(
    ("latex", "text"),
    [
        (
            r"We introduce \textbf{Evaluation Illusion}, a \emph{new} effect",
            "We introduce Evaluation Illusion, a new effect",
        ),
        (
            r"Scaling Laws for $\alpha$-Divergence Training",
            "Scaling Laws for α-Divergence Training",
        ),
        (r"$O(n^2)$ and $\mathcal{O}(\log n)$", "O(n²) and O(log n)"),
        (r"$x_{i}^{2} \leq 10$", "xᵢ² ≤ 10"),
        (r"$V_{0.5}$ and $W_{\text{out}}$ and $\frac{1}{2}$", "V_0.5 and W_out and 1/2"),
        (r"Sch\"olkopf and G{\"o}del", "Schölkopf and Gödel"),
        (r"pages 3--5 --- 40\% fewer~tokens", "pages 3–5 — 40% fewer tokens"),
        (r"as shown \cite{smith2020}. See \url{https://x.org}", "as shown. See https://x.org"),
        (r"costs \$5 and $\$$", "costs $5 and $"),
        (r"an \unknownmacro{argument} stays readable", "an argument stays readable"),
        ("plain text, no LaTeX", "plain text, no LaTeX"),
        ("a $ alone", "a $ alone"),
    ],
)
def test_latex_to_text(latex, text):
    assert latex_to_text(latex) == text
