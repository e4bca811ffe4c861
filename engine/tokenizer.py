"""Loading a model folder's tokenizer (offline) and rendering chat prompts."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.errors import InvalidRequestError, ModelLoadError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None when it ships none (token-id prompts only)."""
    if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {model_dir}: {e}") from e


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    if not messages:
        raise InvalidRequestError("conversation is empty: at least one message is required")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequestError(f"message {i} must be a mapping with 'role' and 'content'")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("the model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template already holds any BOS it wants; adding special tokens again would double it.
    return tokenizer.encode(text, add_special_tokens=False)
