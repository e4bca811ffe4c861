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


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The conversation rendered by the chat template (the model's, or chat_template for this
    request), as token ids. continue_final_message leaves the last (assistant) message open, to
    be continued; template_kwargs are extra variables for the template (enable_thinking, ...).
    A template that fails to render is the caller's error, naming chat_template when the caller
    gave it."""
    if not messages:
        raise InvalidRequestError("conversation is empty: at least one message is required")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequestError(f"message {i} must be a mapping with 'role' and 'content'")
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("the model's tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as e:  # noqa: BLE001 - the template is data: any failure is the input's
        field = "chat_template" if chat_template else "messages"
        source = "the request's chat_template" if chat_template else "the model's chat template"
        raise InvalidRequestError(
            f"{source} failed to render these messages: {type(e).__name__}: {e}", field
        ) from None
    # The template already holds any BOS it wants; adding special tokens again would double it.
    return tokenizer.encode(text, add_special_tokens=False)


def template_text(tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None) -> str:
    """The Jinja text a request renders with: its own chat_template, or the model's (the one
    for tool use, where the model ships several)."""
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return template
