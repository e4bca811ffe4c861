"""Streaming detokenization of one request's output, with its stop strings.

Text comes from the `tokenizers` library's DecodeStream (as in vLLM's FastIncrementalDetokenizer):
fed one token at a time, it returns None while the text would end in an incomplete UTF-8
character, and the new text once the character is whole.

What the text is: exactly what the output tokens add to the prompt's text, i.e.
`decode(prompt_tail + output)[len(decode(prompt_tail)):]`. For byte-level BPE that equals
`decode(output)`. For SentencePiece-style tokenizers (Metaspace or a Strip decoder) it differs from
`decode(output)` only in the first token's leading space, which is kept ("▁Hello" after a prompt
is " Hello"), as vLLM does. Tokenization-space cleanup (" ." -> ".") is never applied: it looks
ahead, so a stream cannot apply it.

Undecodable bytes (the model emitted an invalid UTF-8 byte sequence) come out as U+FFFD:
- a trailing incomplete character is held back until the request finishes, then released as
  U+FFFD, so the complete text still equals the full decode;
- byte-fallback tokenizers (ByteFallback decoder) turn a whole run of byte tokens into U+FFFD,
  one per token, once the run is invalid -- including valid bytes already streamed. Streamed text
  cannot be taken back, so those earlier characters stay as first decoded and only the rest of the
  run becomes U+FFFD; the output then differs from the full decode in those positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

_REPLACEMENT = "\ufffd"
# tokenizers raises a bare Exception when later tokens change text it already returned; the
# message is the only way to tell it from a real bug.
_INVALID_PREFIX = "Invalid prefix encountered"
# Prompt tail that primes the stream: a few tokens suffice for leading-space handling; the upper
# bound only lets the tail start further back when it would otherwise start mid-character.
_PRIME_MIN_TOKENS = 4
_PRIME_MAX_TOKENS = 24
# A UTF-8 character has at most 4 bytes, so at most 3 prompt tokens can end in an incomplete one.
_PRIME_MAX_DANGLING = 3


def backend_of(tokenizer: PreTrainedTokenizerFast | Tokenizer) -> Tokenizer:
    """The Rust `tokenizers.Tokenizer` behind a transformers fast tokenizer (or itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"{type(tokenizer).__name__} has no `tokenizers` backend to stream with")
    return backend


def detokenize_full(
    tokenizer: PreTrainedTokenizerFast | Tokenizer,
    token_ids: list[int],
    skip_special_tokens: bool = True,
) -> str:
    """Decode in one go, the way the stream does (no tokenization-space cleanup)."""
    return backend_of(tokenizer).decode(token_ids, skip_special_tokens=skip_special_tokens)


@dataclass(slots=True)
class _TextBuffer:
    """Append-only text held as chunks, so an append or a look at the tail costs O(that part),
    not O(whole text) as `str +=` on an attribute does."""

    parts: list[str] = field(default_factory=list)
    length: int = 0

    def append(self, text: str) -> None:
        if text:
            self.parts.append(text)
            self.length += len(text)

    def tail(self, n: int) -> str:
        """The last n characters (all of them when the text is shorter)."""
        if n <= 0:
            return ""
        pieces: list[str] = []
        size = 0
        for part in reversed(self.parts):
            pieces.append(part)
            size += len(part)
            if size >= n:
                break
        return "".join(reversed(pieces))[-n:]

    def truncate(self, n: int) -> None:
        """Keep the first n characters."""
        while self.length > n:
            last = self.parts.pop()
            self.length -= len(last)
            if self.length < n:
                self.append(last[: n - self.length])

    def text(self) -> str:
        joined = "".join(self.parts)
        # Store the joined string so that reading the whole text again costs nothing.
        self.parts[:] = [joined] if joined else []
        return joined


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text step by step and applies its stop strings.

    `update` takes the new tokens and reports a stop string; `get_next_delta` hands out the text
    a streaming client may see so far. Stop strings count only once more than
    `params.min_tokens` tokens are out (vLLM's rule), and the one that completes first in the
    text wins (ties: first in `params.stop`), so the result does not depend on how tokens are
    grouped into updates.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast | Tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self._backend = backend_of(tokenizer)
        self._skip_special = params.skip_special_tokens
        self._stops = tuple(params.stop)
        self._max_stop_len = max(map(len, self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._stream = self._new_stream(self._prime_ids(prompt_token_ids))
        self._pending: list[int] = []  # tokens the stream took without returning text yet
        self._num_tokens = 0
        self._text = _TextBuffer()
        self._sent = 0  # characters already handed out by get_next_delta
        self._stop_str: str | None = None
        self._finished = False

    @property
    def output_text(self) -> str:
        return self._text.text()

    @property
    def num_tokens(self) -> int:
        """Tokens taken by update(); after a stop, those up to the one that completed it."""
        return self._num_tokens

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stop_str

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append generated tokens; return the stop string if one now appears in the text."""
        if self._stop_str is not None or self._finished:
            return None
        for token_id in new_token_ids:
            self._num_tokens += 1
            chunk = self._step(token_id)
            if not chunk:
                continue
            self._text.append(chunk)
            if self._stops and self._num_tokens > self._min_tokens and self._find_stop(len(chunk)):
                return self._stop_str
        return None

    def get_next_delta(self, finished: bool) -> str:
        """Text not returned by earlier calls. Until finished (or stopped), the tail that could
        still grow into a stop string is held back, so a client never sees part of one."""
        if finished and not self._finished:
            self._finished = True
            self._flush()
        end = self._text.length
        if not finished and self._stop_str is None:
            end -= self._partial_stop_len()
        if end <= self._sent:
            return ""
        delta = self._text.tail(self._text.length - self._sent)[: end - self._sent]
        self._sent = end
        return delta

    def _step(self, token_id: int) -> str | None:
        try:
            chunk = self._stream.step(self._backend, token_id)
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            chunk = self._restart(self._pending + [token_id])
        if chunk is None:
            self._pending.append(token_id)
        else:
            self._pending.clear()
        return chunk

    def _restart(self, token_ids: list[int]) -> str:
        """Recover from a stream whose newest decode contradicts text it already returned (a
        byte-fallback run turned invalid; vLLM issue 17448): what was returned stays, the tokens
        since then are decoded on their own and become the new stream's context."""
        self._stream = self._new_stream(token_ids)
        return self._decode(token_ids)

    def _flush(self) -> None:
        """Release what the stream still holds: bytes that never formed a whole character."""
        if self._stop_str is None and self._pending:
            self._text.append(self._decode(self._pending))
        self._pending.clear()

    def _find_stop(self, new_chars: int) -> bool:
        """Look for a stop string ending in the newest `new_chars` characters; on a hit cut the
        text there. Only the new text and `len(stop) - 1` characters before it are searched:
        any earlier occurrence would have ended in an earlier chunk."""
        window = self._text.tail(new_chars + self._max_stop_len - 1)
        best: tuple[int, int, str] | None = None  # (end, start, stop) within window
        for stop in self._stops:
            start = window.find(stop, max(0, len(window) - new_chars - len(stop) + 1))
            if start >= 0 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start, stop)
        if best is None:
            return False
        end, start, self._stop_str = best
        offset = self._text.length - len(window)
        self._text.truncate(offset + (end if self._include_stop else start))
        return True

    def _partial_stop_len(self) -> int:
        """Length of the longest end of the text that is the start of some stop string."""
        tail = self._text.tail(self._max_stop_len - 1)
        for size in range(len(tail), 0, -1):
            suffix = tail[-size:]
            if any(len(stop) > size and stop.startswith(suffix) for stop in self._stops):
                return size
        return 0

    def _prime_ids(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt tail the stream starts from, so the first output token decodes as it does
        after the prompt (SentencePiece "▁Hello" is " Hello" there, "Hello" alone).

        The tail must decode cleanly at both ends. Starting mid-character turns a byte-fallback
        run into U+FFFD. Ending mid-character makes DecodeStream drop the context and repeat the
        whole tail in the first output (tokenizers 0.23), so such trailing tokens are left out:
        the output then starts with U+FFFD for the rest of that character.
        """
        prompt = list(prompt_token_ids)
        for dangling in range(min(_PRIME_MAX_DANGLING, len(prompt)) + 1):
            end = len(prompt) - dangling
            for size in range(min(_PRIME_MIN_TOKENS, end), min(_PRIME_MAX_TOKENS, end) + 1):
                text = self._decode(prompt[end - size : end])
                if not text.startswith(_REPLACEMENT) and not text.endswith(_REPLACEMENT):
                    return prompt[end - size : end]
        return []

    def _new_stream(self, context_ids: list[int]) -> DecodeStream:
        try:
            return DecodeStream(ids=context_ids, skip_special_tokens=self._skip_special)
        except TypeError:  # tokenizers < 0.22 takes no ids: prime by stepping, output discarded
            stream = DecodeStream(skip_special_tokens=self._skip_special)
            try:
                for token_id in context_ids:
                    stream.step(self._backend, token_id)
            except Exception as e:
                if not str(e).startswith(_INVALID_PREFIX):
                    raise
                return DecodeStream(skip_special_tokens=self._skip_special)
            return stream

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special)
