"""A token's own bytes (chat logprobs' `bytes`): joined over a text's tokens they are the text's
UTF-8, also where one character spans tokens and each decodes alone to U+FFFD."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.model_fetch import fetch_default_model
from engine.server.token_bytes import TokenBytes


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(fetch_default_model()))


@pytest.mark.parametrize("text", ["日本語", " hello world", "Ελληνικά", "🙂 ok", "a\u00a0b\n\t"])
def test_bytes_join_to_the_text(tokenizer, text):
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(bytes(token_bytes(i)) for i in ids) == text.encode()
    if any(tokenizer.decode([i]) == "\ufffd" for i in ids):
        # the case the decoded text cannot serve: a part of a character
        assert any(bytes(token_bytes(i)) != "\ufffd".encode() for i in ids)


def test_without_a_tokenizer_the_id_stands_for_itself():
    assert TokenBytes(None)(42) == list(b"42")
