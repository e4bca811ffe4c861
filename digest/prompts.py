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
# .4: the paper without label words (the default model copied "Title:", "Authors:",
# "Categories:" and "Abstract:" into 5 of its 9 unfaithful summaries) and without the metadata
# a summary has no use for; the summary task asks what problem the paper addresses first (the
# model opened with an invented venue, "The paper, published in the Journal of ...").
# .5: the review task without "Task:" either (no label word left in any prompt).
PROMPT_VERSION = "2026-12-05.5"
# The first version that shows the paper without its authors, categories and arXiv id: a
# summary's facts are checked against what its prompt showed (digest/faithfulness.py).
FIRST_WITHOUT_METADATA = "2026-12-05.4"

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
    "In three or four plain sentences, explain what problem the paper above addresses, how it "
    "addresses it, what it finds, and why that matters, for a technical reader outside the "
    "field. Use only the numbers and names the paper gives."
)

# Besides the paper, all that a summary call tells the model (a sentence reciting it is dropped).
SUMMARY_INSTRUCTIONS = f"{SYSTEM}\n{SUMMARY_TASK}"

REVIEW_TASK = """Review the paper above. Reply with one JSON object and nothing else, with \
exactly these keys:
- "summary": one or two sentences on what the paper claims;
- "strengths", "weaknesses", "questions", "limitations": lists of 1 to 4 items, each a short \
phrase in words (4 to 15 words), not a number;
- "soundness", "presentation", "contribution": integers 1 (poor) to 4 (excellent), or null when \
the text given is not enough to judge;
- "overall": integer 1 (reject) to 10 (award quality), 6 or more meaning accept; "confidence": \
integer 1 to 5;
- "input_basis": "{basis}"."""

# The summary tasks of earlier versions whose results were measured (docs/PERFORMANCE.md), so
# that a store they wrote is measured against what its model was told (digest/quality.py).
EARLIER_SUMMARY_TASKS = {
    "2026-11-29.2": "Task: summarize the paper above in 3 to 5 plain sentences for a technical "
    "reader outside the field: the problem, the approach, the main result, and why it matters. "
    "Plain prose only: no lists, no headings, no preamble.",
    "2026-12-05.3": "Task: summarize the paper above in three or four short plain sentences for "
    "a technical reader outside the field: the problem, the approach, the main result, and why it "
    "matters. Use only numbers and names that appear in the text above. Plain prose only: no "
    "lists, no headings, no preamble.",
    "2026-12-05.4": SUMMARY_TASK,
}


def summary_instructions(prompt_version: str = PROMPT_VERSION) -> str | None:
    """What the summary call told the model besides the paper (system text and task), for
    `prompt_version`; None for a version not recorded here."""
    if prompt_version == PROMPT_VERSION:
        return SUMMARY_INSTRUCTIONS
    task = EARLIER_SUMMARY_TASKS.get(prompt_version)
    return f"{SYSTEM}\n{task}" if task is not None else None


def shows_metadata(prompt_version: str) -> bool:
    """Whether that version's paper block showed authors, categories and the arXiv id."""
    return _version_key(prompt_version) < _version_key(FIRST_WITHOUT_METADATA)


def _version_key(version: str) -> tuple[str, int]:
    day, _, number = version.partition(".")
    return day, int(number) if number.isdigit() else 0


# Where a truncated full text was cut: a mark, not words the model could repeat as its own.
CUT_MARK = "[…]"


def paper_block(paper: Paper, basis: InputBasis, text: str, truncated: bool = False) -> str:
    """The paper as the model sees it: its title line, a blank line, then the abstract or the
    full text, as plain text. No label words ("Title:", "Authors:", "Abstract:"): a small model
    copies them into its summary as if they were the paper's (issue 19). No authors, categories
    or arXiv id either: a summary does not need them, a review is better blind to the authors,
    and every field shown is one more to copy. `basis` is the review task's to say."""
    body = f"{text}\n{CUT_MARK}" if basis == "fulltext" and truncated else text
    return f"{paper.title}\n\n{body}"


def _messages(block: str, task: str) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{block}\n\n{task}"},
    ]


def summary_messages(block: str) -> list[dict]:
    return _messages(block, SUMMARY_TASK)


def review_messages(block: str, basis: InputBasis) -> list[dict]:
    return _messages(block, REVIEW_TASK.format(basis=basis))
