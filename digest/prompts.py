"""The digest's prompts, versioned: a change of wording is a new PROMPT_VERSION, so stored results
say which prompt produced them and a rerun with a new prompt redoes the work.

Every prompt is ordered shared system text, then the paper, then the task. The summary and the
review of one paper therefore share a long token prefix, which a prefix cache (ours, or a cloud
provider's) computes once."""

from __future__ import annotations

from digest.paper import Paper
from digest.review import InputBasis

# .2: review schema length bounds, frequency penalty. 2026-12-05: issue 19 (the decision is no
# longer asked, list items bounded to phrases, the summary asked shorter and with a penalty).
# .2: no pattern on the review summary; .3: no digits in the summary task (the default model
# copied "3 or 4 ... 90 words" into its summaries, which the faithfulness check then flagged).
PROMPT_VERSION = "2026-12-05.3"

SUMMARY_MAX_TOKENS = 256
REVIEW_MAX_TOKENS = 768
# An OpenAI parameter: discourages the loops a small model falls into inside a constrained JSON
# string or list (on the default model, 4 of 6 reviews validated without it, see PERFORMANCE.md).
REVIEW_FREQUENCY_PENALTY = 0.5
# The summary, too, loops without a penalty (9 of 23 repeated a sentence, issue 19); a summary that
# still loops (digest/repetition.py) is asked once more under the stronger one.
SUMMARY_FREQUENCY_PENALTY = 0.3
SUMMARY_RETRY_FREQUENCY_PENALTY = 1.0

SYSTEM = (
    "You are a careful, fair reviewer writing a nightly digest of new research papers for busy "
    "engineers. Base every statement only on the paper text you are given; do not invent results, "
    "numbers or claims. When only the abstract is given, say less rather than guess."
)

SUMMARY_TASK = (
    "Task: summarize the paper above in three or four short plain sentences for a technical "
    "reader outside the field: the problem, the approach, the main result, and why it matters. "
    "Use only numbers and names that appear in the text above. Plain prose only: no lists, no "
    "headings, no preamble."
)

REVIEW_TASK = """Task: review the paper above. Reply with one JSON object and nothing else, with \
exactly these keys:
- "summary": one or two sentences on what the paper claims;
- "strengths", "weaknesses", "questions", "limitations": lists of 1 to 4 items, each a short \
phrase in words (4 to 15 words), not a number;
- "soundness", "presentation", "contribution": integers 1 (poor) to 4 (excellent), or null when \
the text given is not enough to judge;
- "overall": integer 1 (reject) to 10 (award quality), 6 or more meaning accept; "confidence": \
integer 1 to 5;
- "input_basis": "{basis}"."""


def paper_block(paper: Paper, basis: InputBasis, text: str, truncated: bool = False) -> str:
    """The paper as the model sees it: metadata, then the abstract or the full text."""
    lines = [
        f"Title: {paper.title}",
        f"Authors: {', '.join(paper.authors)}",
        f"Categories: {', '.join(paper.categories)}",
        f"arXiv: {paper.arxiv_id}v{paper.version}",
        "",
    ]
    if basis == "fulltext":
        note = " (truncated)" if truncated else ""
        lines += [f"Full text{note}:", text]
    else:
        lines += ["Abstract:", text]
    return "\n".join(lines)


def _messages(block: str, task: str) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{block}\n\n{task}"},
    ]


def summary_messages(block: str) -> list[dict]:
    return _messages(block, SUMMARY_TASK)


def review_messages(block: str, basis: InputBasis) -> list[dict]:
    return _messages(block, REVIEW_TASK.format(basis=basis))
