"""What a request's prompt looks like to the router: its text, cut into blocks of characters and
chain-hashed, so that two requests share their first k block hashes exactly when their texts
share their first k blocks. The router has no tokenizer (its replicas may even serve different
ones); characters stand in for tokens, which is all that affinity needs: requests that share a
long text prefix share a long token prefix."""

from __future__ import annotations

import hashlib
import json

DEFAULT_BLOCK_CHARS = 64
# Beyond this many blocks (256k characters by default) the rest of a prompt changes no choice
# worth its hashing time.
MAX_BLOCKS = 4096


def routing_text(body: object) -> str:
    """The prompt text of an OpenAI request body: chat messages as the template would order
    them (role, then content), a completion's prompt, an embedding's input; "" when there is
    none (a malformed body is the replica's to refuse, not ours)."""
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages)
    for field in ("prompt", "input"):
        if field in body:
            return _prompt_text(body[field])
    return ""


def _message_text(message: object) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):  # content parts: the text ones, in order
        content = "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    # Separators a message's text cannot fake, so that ("ab", "c") and ("a", "bc") differ.
    return f"\x1e{message.get('role', '')}\x1f{'' if content is None else content}"


def _prompt_text(prompt: object) -> str:
    """A prompt: a string, token ids, or a batch of either (routed by its first)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str | list):
            return _prompt_text(first)
        return " ".join(str(t) for t in prompt)  # token ids: one "word" each
    return ""


def block_hashes(
    text: str, block_chars: int = DEFAULT_BLOCK_CHARS, max_blocks: int = MAX_BLOCKS
) -> list[bytes]:
    """Chained hashes of the text's full blocks: block i's hash covers blocks 0..i (vLLM's
    block hashes, over characters). A trailing partial block is left out, as a prefix cache
    leaves out a partial KV block."""
    if block_chars < 1:
        raise ValueError(f"the prefix block size must be at least 1 character, got {block_chars}")
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, min(len(text), block_chars * max_blocks) - block_chars + 1, block_chars):
        block = text[start : start + block_chars].encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        hashes.append(parent)
    return hashes


def body_block_hashes(raw: bytes, block_chars: int = DEFAULT_BLOCK_CHARS) -> list[bytes]:
    """The block hashes of a raw request body; none for a body that is not JSON."""
    if not raw:
        return []
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return []
    return block_hashes(routing_text(body), block_chars)
