"""The /tokenize and /detokenize bodies, in vLLM's shapes: tokenize takes a prompt (text) or a
conversation (messages, rendered as /v1/chat/completions renders it, with the chat template's
fields); unknown fields are accepted and named in the log."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from engine.server.errors import APIError
from engine.server.protocol import OpenAIBaseModel
from engine.server.protocol_chat import ChatCompletionRequest, ChatMessage, ChatTool


class TokenizeRequest(OpenAIBaseModel):
    is_body = True
    model: str | None = None  # None: the served model
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # A prompt gets the tokenizer's special tokens (BOS) unless this is false; a conversation
    # gets those its chat template writes, and no others.
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    # The chat template's fields (vLLM's names), for messages only.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    tools: list[ChatTool] | None = None
    documents: list[dict] | None = None

    def check_form(self) -> None:
        """Exactly one of prompt and messages."""
        if self.prompt is None and self.messages is None:
            raise APIError(400, "give a prompt (text) or messages to tokenize", param="prompt")
        if self.prompt is not None and self.messages is not None:
            raise APIError(400, "give a prompt or messages, not both", param="messages")
        if self.messages == []:
            raise APIError(400, "messages is empty: give at least one message", param="messages")
        if self.messages is not None and self.add_special_tokens:
            raise APIError(
                400,
                "add_special_tokens applies to a prompt; a conversation has the special tokens "
                "its chat template writes",
                param="add_special_tokens",
            )

    def as_chat(self) -> ChatCompletionRequest:
        """The conversation as a chat request, so that it is checked and rendered by the chat
        endpoint's own rules (roles, content parts, tools, continue_final_message): tokenize
        counts exactly the tokens a chat completion would get. Built without validation: every
        field it reads was validated here, with the same types."""
        return ChatCompletionRequest.model_construct(
            model=self.model,
            messages=self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template=self.chat_template,
            chat_template_kwargs=self.chat_template_kwargs,
            tools=self.tools,
            documents=self.documents,
        )


class DetokenizeRequest(OpenAIBaseModel):
    is_body = True
    model: str | None = None  # None: the served model
    # Any here, checked in token_ids(): a refusal names `tokens`, not one of its items.
    tokens: Any = Field(description="The token ids to turn back into text.")

    def token_ids(self, vocab_size: int) -> list[int]:
        value = self.tokens
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            raise APIError(400, "tokens must be a list of token ids (integers)", param="tokens")
        bad = next((t for t in value if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(
                400,
                f"tokens: token id {bad} is outside the vocabulary [0, {vocab_size})",
                param="tokens",
            )
        return list(value)
