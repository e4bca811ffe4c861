"""Streaming detokenization: equality with one-shot decoding across UTF-8 boundaries, prompt
priming, and stop strings that span tokens. Runs on two small tokenizers trained here (no hub):
a byte-level BPE (GPT-2 style) and a SentencePiece-style BPE with byte fallback (Llama style)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

import engine.detokenizer as detokenizer_module
from engine.detokenizer import IncrementalDetokenizer, _TextBuffer, detokenize_full
from engine.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
WORDS = [
    "hello", "world", "the", "engine", "stream", "token", "naïve", "café", "Größe", "日本語",
    "中文字符", "한국어", "ελληνικά", "русский", "🙂", "🚀", "👩‍💻", "🇫🇷", "\n", "\n\n", "  ", "\t",
    "éèê", "عربى", "end.", "stop", "STOP", "###", "</end>",
]  # fmt: skip
# Characters the tokenizers never saw, so they split into single bytes.
RARE = "ẞ𝄞ऋ🦀€ñø¿Ω∑≠🫠"
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _corpus(lines: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 15))) for _ in range(lines)]


def _byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


def _byte_fallback_bpe() -> PreTrainedTokenizerFast:
    """Llama-2 layout: <unk> <s> </s>, then the 256 <0xNN> byte tokens, then learned pieces."""
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    learned = Tokenizer(models.BPE())
    learned.pre_tokenizer = metaspace
    # A small alphabet leaves many characters to byte fallback.
    trainer = trainers.BpeTrainer(vocab_size=300, limit_alphabet=50, show_progress=False)
    learned.train_from_iterator(_corpus(), trainer)
    specials = ["<unk>", "<s>", "</s>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
    pieces += sorted(learned.get_vocab(), key=learned.get_vocab().get)
    vocab = {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}
    merges = [tuple(m) for m in json.loads(learned.to_str())["model"]["merges"]]
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return _byte_level_bpe()


@pytest.fixture(scope="module")
def byte_fallback() -> PreTrainedTokenizerFast:
    return _byte_fallback_bpe()


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tok(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return request.getfixturevalue(request.param)


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def has_byte_tokens(tok: PreTrainedTokenizerFast) -> bool:
    return "<0x00>" in tok.get_vocab()


def byte_ids(tok: PreTrainedTokenizerFast, data: bytes) -> list[int]:
    """One token per byte, however the tokenizer spells a lone byte."""
    if has_byte_tokens(tok):
        return tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in data])
    # GPT-2's byte-to-character table: printable bytes stand for themselves, the rest for U+0100...
    table = {b: chr(b) for b in [*range(33, 127), *range(161, 173), *range(174, 256)]}
    table.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in table)})
    return tok.convert_tokens_to_ids([table[b] for b in data])


def run(
    tok: PreTrainedTokenizerFast,
    output_ids: list[int],
    params: SamplingParams | None = None,
    prompt_ids: list[int] | None = None,
    group_sizes: list[int] | None = None,
    peek: bool = True,
) -> tuple[IncrementalDetokenizer, list[str], list[str | None]]:
    """Feed output_ids in groups (sizes cycled) until a stop, taking a delta after each group
    when peek; return the detokenizer, every delta (the last with finished=True) and what each
    update returned."""
    detok = IncrementalDetokenizer(tok, prompt_ids or [], params or SamplingParams())
    sizes = group_sizes or [1]
    deltas: list[str] = []
    stops: list[str | None] = []
    i = 0
    while i < len(output_ids):
        size = sizes[len(stops) % len(sizes)]
        stops.append(detok.update(output_ids[i : i + size]))
        i += size
        if peek:
            deltas.append(detok.get_next_delta(finished=False))
        if stops[-1] is not None:
            break  # as the engine does: a stop string finishes the request
    deltas.append(detok.get_next_delta(finished=True))
    assert "".join(deltas) == detok.output_text
    assert detok.get_next_delta(finished=True) == ""
    return detok, deltas, stops


def texts() -> st.SearchStrategy[str]:
    words = st.lists(st.sampled_from(WORDS + list(RARE)), max_size=12).map(" ".join)
    chars = st.text(st.characters(codec="utf-8"), max_size=20)
    return st.one_of(words, chars, st.tuples(words, chars).map("".join))


group_sizes = st.lists(st.integers(1, 4), min_size=1, max_size=5)


# --- equality with one-shot decoding ---


@SETTINGS
@given(text=texts(), sizes=group_sizes, peek=st.booleans(), skip=st.booleans())
def test_stream_equals_full_decode_of_real_text(
    tok: PreTrainedTokenizerFast, text: str, sizes: list[int], peek: bool, skip: bool
) -> None:
    ids = encode(tok, text) + [tok.eos_token_id]
    params = SamplingParams(skip_special_tokens=skip)
    detok, _, _ = run(tok, ids, params, group_sizes=sizes, peek=peek)
    assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)


@SETTINGS
@given(prompt=texts(), text=texts(), sizes=group_sizes)
def test_stream_after_prompt_equals_what_output_adds(
    tok: PreTrainedTokenizerFast, prompt: str, text: str, sizes: list[int]
) -> None:
    prompt_ids, ids = encode(tok, prompt), encode(tok, text)
    detok, _, _ = run(tok, ids, prompt_ids=prompt_ids, group_sizes=sizes)
    head, full = tok.decode(prompt_ids), tok.decode(prompt_ids + ids)
    assert full.startswith(head)
    assert detok.output_text == full[len(head) :]


@SETTINGS
@given(prompt=texts(), text=texts(), sizes=group_sizes)
def test_byte_level_output_never_depends_on_prompt(
    byte_level: PreTrainedTokenizerFast, prompt: str, text: str, sizes: list[int]
) -> None:
    ids = encode(byte_level, text)
    detok, _, _ = run(byte_level, ids, prompt_ids=encode(byte_level, prompt), group_sizes=sizes)
    assert detok.output_text == byte_level.decode(ids)


@SETTINGS
@given(data=st.data(), sizes=group_sizes, skip=st.booleans())
def test_random_ids_byte_level_equal_full_decode_even_when_invalid(
    byte_level: PreTrainedTokenizerFast, data: st.DataObject, sizes: list[int], skip: bool
) -> None:
    """Byte-level decoding is lossy UTF-8 over the concatenated bytes, which never changes
    text already complete, so even invalid bytes stream exactly as the full decode (U+FFFD)."""
    token_id = st.integers(0, len(byte_level) - 1)
    prompt_ids = data.draw(st.lists(token_id, max_size=10))
    ids = data.draw(st.lists(token_id, max_size=16))
    params = SamplingParams(skip_special_tokens=skip)
    detok, _, _ = run(byte_level, ids, params, prompt_ids, sizes)
    assert detok.output_text == byte_level.decode(ids, skip_special_tokens=skip)


@SETTINGS
@given(data=st.data(), sizes=group_sizes, skip=st.booleans())
def test_random_ids_byte_fallback_equal_full_decode_when_valid(
    byte_fallback: PreTrainedTokenizerFast, data: st.DataObject, sizes: list[int], skip: bool
) -> None:
    """Random ids are mostly invalid UTF-8 here. Where the decode holds no U+FFFD the stream
    must match it; elsewhere it must not raise (ByteFallback rewrites a whole run of byte
    tokens to U+FFFD once it turns invalid, which a stream cannot do to text it returned)."""
    token_id = st.integers(0, len(byte_fallback) - 1)
    prompt_ids = data.draw(st.lists(token_id, max_size=10))
    ids = data.draw(st.lists(token_id, max_size=16))
    params = SamplingParams(skip_special_tokens=skip)
    detok, _, _ = run(byte_fallback, ids, params, prompt_ids, sizes)
    head = byte_fallback.decode(prompt_ids, skip_special_tokens=skip)
    full = byte_fallback.decode(prompt_ids + ids, skip_special_tokens=skip)
    if REPLACEMENT not in full and full.startswith(head):
        assert detok.output_text == full[len(head) :]


def test_multibyte_characters_split_into_byte_tokens(tok: PreTrainedTokenizerFast) -> None:
    text = "a🦀b日c👩‍💻"
    ids = byte_ids(tok, text.encode())
    detok, deltas, _ = run(tok, ids)
    assert detok.output_text == text == tok.decode(ids)
    # Nothing comes out while a character is incomplete: every delta is whole characters.
    assert [d for d in deltas if d] == ["a", "🦀", "b", "日", "c", "👩", "\u200d", "💻"]


def test_incomplete_trailing_character_is_released_as_replacement(
    tok: PreTrainedTokenizerFast,
) -> None:
    ids = byte_ids(tok, "ok🦀".encode()[:-1])
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.update(ids)
    assert detok.get_next_delta(finished=False) == "ok"
    assert detok.output_text == "ok"
    # U+FFFD for what the dangling bytes decode to on their own: one for byte-level, one per
    # byte token for ByteFallback (whose full decode turns the whole run, "ok" too, into U+FFFD).
    tail = detok.get_next_delta(finished=True)
    assert tail == tok.decode(ids[2:]) and set(tail) == {REPLACEMENT}
    assert detok.update(encode(tok, "more")) is None  # finished: ignored
    assert detok.output_text == "ok" + tail
    if not has_byte_tokens(tok):
        assert detok.output_text == tok.decode(ids)


# --- prompt priming ---


def test_priming_keeps_first_tokens_leading_space(byte_fallback: PreTrainedTokenizerFast) -> None:
    ids = encode(byte_fallback, "the engine")
    assert byte_fallback.convert_ids_to_tokens(ids) == ["▁the", "▁engine"]
    after_prompt, _, _ = run(byte_fallback, ids[1:], prompt_ids=ids[:1])
    alone, _, _ = run(byte_fallback, ids[1:])
    assert after_prompt.output_text == " engine"
    assert alone.output_text == "engine" == byte_fallback.decode(ids[1:])


def test_prompt_ending_mid_character_does_not_leak_into_output(
    tok: PreTrainedTokenizerFast,
) -> None:
    """DecodeStream primed with a tail ending mid-character would repeat the whole tail in the
    first output; the dangling bytes are left out of the context instead."""
    ids = encode(tok, "hello world ") + byte_ids(tok, "🦀".encode())
    detok, _, _ = run(tok, ids[-1:], prompt_ids=ids[:-1])
    assert detok.output_text == REPLACEMENT == tok.decode(ids[-1:])


def test_prompt_of_special_tokens_only(tok: PreTrainedTokenizerFast) -> None:
    ids = encode(tok, "the engine")
    detok, _, _ = run(tok, ids, prompt_ids=[tok.eos_token_id])
    assert detok.output_text == tok.decode([tok.eos_token_id] + ids, skip_special_tokens=True)


def test_priming_by_stepping_when_decode_stream_takes_no_ids(
    byte_fallback: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    def old_decode_stream(ids: list[int] | None = None, skip_special_tokens: bool = False):
        if ids is not None:
            raise TypeError("DecodeStream() got an unexpected keyword argument 'ids'")
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(detokenizer_module, "DecodeStream", old_decode_stream)
    prompt = encode(byte_fallback, "hello world the")
    ids = encode(byte_fallback, " engine 日本語 🦀")
    detok, _, _ = run(byte_fallback, ids, prompt_ids=prompt)
    full = byte_fallback.decode(prompt + ids)
    assert detok.output_text == full[len(byte_fallback.decode(prompt)) :] == " engine 日本語 🦀"


# --- special tokens and odd ids ---


def test_special_tokens(tok: PreTrainedTokenizerFast) -> None:
    ids = encode(tok, "hi") + [tok.eos_token_id]
    kept, _, _ = run(tok, ids, SamplingParams(skip_special_tokens=False))
    skipped, _, _ = run(tok, ids, SamplingParams(skip_special_tokens=True))
    assert kept.output_text == tok.decode(ids, skip_special_tokens=False)
    assert kept.output_text.endswith(tok.eos_token)
    assert skipped.output_text == "hi"


def test_ids_beyond_the_vocabulary_decode_to_nothing(tok: PreTrainedTokenizerFast) -> None:
    """Models often pad the embedding past the tokenizer's vocabulary."""
    detok, _, _ = run(tok, encode(tok, "hi") + [len(tok) + 7] + encode(tok, " there"))
    assert detok.output_text == "hi there"


def test_recovers_when_byte_fallback_rewrites_returned_text(
    byte_fallback: PreTrainedTokenizerFast,
) -> None:
    """'c' as a byte token, then a stray continuation byte: ByteFallback re-decodes the run
    [c, 0xBB] as two U+FFFD, contradicting the 'c' already returned (raw DecodeStream raises)."""
    ids = byte_fallback.convert_tokens_to_ids(["<0x63>", "<0xBB>", "▁hello"])
    raw = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):
        for token_id in ids:
            raw.step(byte_fallback.backend_tokenizer, token_id)
    detok, _, _ = run(byte_fallback, ids + encode(byte_fallback, " world"))
    assert detok.output_text == "c" + REPLACEMENT + " hello world"
    assert byte_fallback.decode(ids) == REPLACEMENT * 2 + " hello"


def test_tokenizer_without_a_rust_backend_is_refused() -> None:
    with pytest.raises(TypeError, match="no `tokenizers` backend"):
        IncrementalDetokenizer(object(), [], SamplingParams())  # type: ignore[arg-type]


def test_detokenize_full_matches_tokenizer_decode(tok: PreTrainedTokenizerFast) -> None:
    ids = [tok.eos_token_id] + encode(tok, "naïve 🦀 日本語\n\n")
    for skip in (True, False):
        assert detokenize_full(tok, ids, skip) == tok.decode(ids, skip_special_tokens=skip)
    assert detokenize_full(tok.backend_tokenizer, ids) == tok.decode(ids, skip_special_tokens=True)


# --- stop strings ---


def test_stop_spanning_two_tokens(tok: PreTrainedTokenizerFast) -> None:
    ids = byte_ids(tok, b"para one\n\npara two")
    detok, deltas, stops = run(tok, ids, SamplingParams(stop=["\n\n"]))
    assert stops[-1] == "\n\n" and stops.count("\n\n") == 1
    assert len(stops) == len(b"para one\n\n")  # stopped on the second newline; rest never fed
    assert detok.output_text == "para one"
    assert "\n" not in "".join(deltas[:-1])


def test_stop_spanning_three_tokens_is_never_streamed_in_part(
    tok: PreTrainedTokenizerFast,
) -> None:
    ids = byte_ids(tok, b"go END now")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["END"]))
    seen = ""
    for i, token_id in enumerate(ids):  # noqa: B007 (i is checked after the loop)
        stop = detok.update([token_id])
        seen += detok.get_next_delta(finished=False)
        assert "E" not in seen
        if stop is not None:
            break
    assert (stop, i) == ("END", len("go END") - 1)
    assert seen + detok.get_next_delta(finished=True) == detok.output_text == "go "


def test_include_stop_str_in_output_cuts_after_it(tok: PreTrainedTokenizerFast) -> None:
    ids = encode(tok, "hello world stop the engine")
    params = SamplingParams(stop=["stop"], include_stop_str_in_output=True)
    detok, _, stops = run(tok, ids, params, group_sizes=[len(ids)])
    assert stops == ["stop"]
    assert detok.output_text == "hello world stop"


def test_stop_inside_one_token_and_updates_after_stop_are_ignored(
    tok: PreTrainedTokenizerFast,
) -> None:
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["ll"]))
    assert detok.update(encode(tok, "hello")) == "ll"
    assert detok.stop_str == "ll"
    assert detok.output_text == "he"
    assert detok.update(encode(tok, " world")) is None
    assert detok.get_next_delta(finished=False) == "he"  # stopped: nothing left to hold back
    assert detok.output_text == "he"


def test_first_completed_stop_wins_then_list_order(tok: PreTrainedTokenizerFast) -> None:
    ids = encode(tok, "xyz")
    one_update = [len(ids)]
    # "yz" starts first but "xy" completes first.
    detok, _, stops = run(tok, ids, SamplingParams(stop=["yz", "xy"]), group_sizes=one_update)
    assert (stops, detok.output_text) == (["xy"], "")
    # Both complete at "z": the earlier in the list wins.
    detok, _, stops = run(tok, ids, SamplingParams(stop=["z", "yz"]), group_sizes=one_update)
    assert (stops, detok.output_text) == (["z"], "xy")


def test_min_tokens_delays_stop_strings(tok: PreTrainedTokenizerFast) -> None:
    ids = byte_ids(tok, b"abxbc")
    detok, _, stops = run(tok, ids, SamplingParams(stop=["b"], min_tokens=2, max_tokens=8))
    assert stops == [None, None, None, "b"]  # the "b" of token 2 is within min_tokens
    assert detok.output_text == "abx"


def test_hold_back_only_what_could_start_a_stop(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["</end>", "STOP"]))
    detok.update(byte_ids(tok, b"hi </en"))
    assert detok.get_next_delta(finished=False) == "hi "
    detok.update(byte_ids(tok, b"x S"))
    assert detok.get_next_delta(finished=False) == "</enx "
    assert detok.get_next_delta(finished=True) == "S"


@SETTINGS
@given(
    text=st.text(st.sampled_from("ab \n🙂é🦀"), max_size=30),
    stops=st.lists(st.text(st.sampled_from("ab \n🙂é🦀"), min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
    sizes=group_sizes,
    peek=st.booleans(),
)
def test_stops_match_a_character_by_character_reference(
    tok: PreTrainedTokenizerFast,
    text: str,
    stops: list[str],
    include: bool,
    sizes: list[int],
    peek: bool,
) -> None:
    """However tokens are grouped, the output is what a check after every character would
    give, and (run() asserts) the streamed deltas add up to it, so no part of an excluded stop
    string was ever streamed."""
    ids = encode(tok, text)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detok, _, results = run(tok, ids, params, group_sizes=sizes, peek=peek)
    expected_text, expected_stop = _reference_stop(tok.decode(ids), stops, include)
    assert detok.output_text == expected_text
    assert detok.stop_str == expected_stop
    assert [r for r in results if r is not None] == ([expected_stop] if expected_stop else [])


def _reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    hits = [(text.find(s) + len(s), i) for i, s in enumerate(stops) if s in text]
    if not hits:
        return text, None
    end, i = min(hits)
    return text[: end if include else end - len(stops[i])], stops[i]


def test_stop_search_reads_only_the_new_text_and_a_short_tail(
    byte_level: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    requested: list[int] = []
    real_tail = _TextBuffer.tail

    def tail(self: _TextBuffer, n: int) -> str:
        requested.append(n)
        return real_tail(self, n)

    def whole_text(self: _TextBuffer) -> str:
        raise AssertionError("update must not rebuild the whole text")

    monkeypatch.setattr(_TextBuffer, "tail", tail)
    monkeypatch.setattr(_TextBuffer, "text", whole_text)
    ids = encode(byte_level, "hello world the engine stream token " * 200)
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["never here"]))
    for token_id in ids:
        assert detok.update([token_id]) is None
    longest_token = max(len(byte_level.decode([i])) for i in set(ids))
    assert max(requested) <= longest_token + len("never here") - 1


# --- text buffer ---


def test_text_buffer_tail_and_truncate() -> None:
    buf = _TextBuffer()
    for part in ["ab", "", "cde", "f"]:
        buf.append(part)
    assert (buf.length, buf.tail(0), buf.tail(2), buf.tail(4), buf.tail(99)) == (
        6, "", "ef", "cdef", "abcdef"
    )  # fmt: skip
    buf.truncate(3)
    assert (buf.text(), buf.length) == ("abc", 3)
    buf.append("xy")
    buf.truncate(1)
    assert (buf.text(), buf.tail(1)) == ("a", "a")
