from __future__ import annotations

from digest.summary_text import tidy_summary


def test_keeps_five_sentences_and_drops_a_cut_off_tail():
    text = "One. Two is $x^2$. Three, e.g. this one. Four!\n\nFive? Six. Seven is cut"
    assert (
        tidy_summary(text, cut_off=True) == "One. Two is $x^2$. Three, e.g. this one. Four! Five?"
    )
    assert tidy_summary("One. Two. Three is cut", cut_off=True) == "One. Two."
    # Not cut off: the last sentence is the model's own, kept even without a full stop.
    assert tidy_summary("One. Two. Three", cut_off=False) == "One. Two. Three"


def test_flattens_lists_and_paragraphs():
    text = "The paper:\n- proposes A.\n- Tests B.\n\n1. Finds C."
    assert tidy_summary(text, cut_off=False) == "The paper: proposes A. Tests B. Finds C."


def test_a_single_unfinished_sentence_is_kept():
    assert tidy_summary("An endless sentence about", cut_off=True) == "An endless sentence about"
