"""POST /tokenize and /detokenize (vLLM's tokenizer endpoints, served at the root as vLLM does):
text or a conversation to token ids, and token ids back to text. The tokenizer runs on a worker
thread; the engine is not involved, so these answer while it is busy."""

from __future__ import annotations

import asyncio

from engine.server.errors import APIError
from engine.server.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from engine.server.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        body.check_form()
        self._need_tokenizer()
        if body.prompt is not None:
            special = body.add_special_tokens is not False
            ids = await asyncio.to_thread(
                self.tokenizer.encode, body.prompt, add_special_tokens=special
            )
        else:
            ids = await asyncio.to_thread(self._render, body)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    def _render(self, body: TokenizeRequest) -> list[int]:
        self.check_request_template(body.chat_template)
        chat = body.as_chat()
        return self.engine.encode_chat(
            chat.template_messages(),
            tools=chat.tool_setup().tools,
            documents=chat.documents,
            chat_template=chat.chat_template,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            template_kwargs=chat.template_kwargs(),
        )

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        ids = body.token_ids(self.info.vocab_size)
        self._need_tokenizer()
        text = await asyncio.to_thread(self.tokenizer.decode, ids)
        return {"prompt": text}

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: it takes and gives token ids only")
