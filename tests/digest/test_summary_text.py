from __future__ import annotations

from digest.summary_text import finish_text, tidy_summary, without_title


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


def test_a_single_unfinished_sentence_ends_at_a_whole_word_never_mid_word():
    # Issue 19: the cut may have gone through the last word ("mod" of "model"): it goes, and so
    # does a dangling "the"; an ellipsis says the sentence was longer.
    assert tidy_summary("An endless sentence about the mod", cut_off=True) == (
        "An endless sentence about…"
    )
    # Not cut off: the model's own last word stays.
    assert tidy_summary("An endless sentence about", cut_off=False) == "An endless sentence about"


def test_a_sentence_said_twice_is_kept_once():
    text = "The paper proposes X. The paper proposes X. It works on Y. The paper proposes X."
    assert tidy_summary(text, cut_off=False) == "The paper proposes X. It works on Y."


def test_finish_text_ends_at_a_sentence_or_a_whole_word():
    assert finish_text("It shows X. It also argues that the eval") == "It shows X."
    assert finish_text("It argues that the evaluation of large langu") == (
        "It argues that the evaluation of large…"
    )
    assert finish_text("Done.") == "Done."
    assert finish_text("") == ""


def test_the_title_copied_in_front_is_dropped():
    """Seen on real papers: the model opens with the title line, without a full stop and once
    with two words run together."""
    title = (
        "PivotAttack: Rethinking the Search Trajectory in Hard-Label Text Attacks via Pivot Words"
    )
    reply = (
        "PivotAttack: Rethinking the Search Trajectory in Hard-Label Text Attacks via PivotWords "
        "PivotAttack is a new approach to hard-label text attacks. It perturbs pivot words."
    )
    assert tidy_summary(reply, cut_off=False, title=title) == (
        "PivotAttack is a new approach to hard-label text attacks. It perturbs pivot words."
    )
    # A summary that names the method first, or is nothing but the title, is left alone.
    assert without_title("PivotAttack is new.", title) == "PivotAttack is new."
    assert without_title(title, title) == title
    assert tidy_summary("Tiny Models: tested. It works.", cut_off=False, title="") == (
        "Tiny Models: tested. It works."
    )


def test_a_sentence_that_loops_is_dropped_with_what_follows_it_kept():
    loop = "they are presented with bold text again using bullet points again"
    reply = (
        f"The paper finds X. It also shows Y. The findings are presented; {loop}; {loop}. "
        f"Then Z follows. And {loop} once more."
    )
    assert (
        tidy_summary(reply, cut_off=False) == "The paper finds X. It also shows Y. Then Z follows."
    )
