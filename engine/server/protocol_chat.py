"""The chat completions request body: messages (text or content parts), the chat API's own
names for sampling fields, and the shared ones from protocol.SamplingRequest."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidSamplingParamsError
from engine.sampling_params import SamplingParams
from engine.server.protocol import SamplingRequest


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def to_sampling_params(self) -> SamplingParams:
        newer = self.max_completion_tokens is not None
        max_tokens = self.max_completion_tokens if newer else self.max_tokens
        try:
            return self.sampling_params(
                max_tokens, (self.top_logprobs or 0) if self.logprobs else None
            )
        except InvalidSamplingParamsError as e:
            # Errors name the chat API's fields, not the engine's.
            e.param = {
                "logprobs": "top_logprobs",
                "max_tokens": "max_completion_tokens" if newer else "max_tokens",
            }.get(e.param, e.param)
            raise
