"""GET /v1/models and /v1/models/{model}: the served model's card, in vLLM's shape (OpenAI's
model object with root, parent, max_model_len and a permission list)."""

from __future__ import annotations

import time
import uuid

from engine.async_engine import EngineInfo
from engine.server.errors import APIError


class OpenAIServingModels:
    def __init__(self, info: EngineInfo, served_model_name: str) -> None:
        self.served_model_name = served_model_name
        self.root = info.model_dir
        self.max_model_len = info.max_model_len
        # Fixed at start: the card does not change while the server runs.
        self.created = int(time.time())
        self._permission_id = f"modelperm-{uuid.uuid4().hex}"

    def list(self) -> dict:
        return {"object": "list", "data": [self.card()]}

    def retrieve(self, name: str) -> dict:
        if name != self.served_model_name:
            raise APIError(
                404,
                f"The model {name!r} does not exist; this server serves {self.served_model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return self.card()

    def card(self) -> dict:
        return {
            "id": self.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "nightshift",
            "root": self.root,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [self._permission()],
        }

    def _permission(self) -> dict:
        # vLLM's ModelPermission, with its values: sampling, logprobs and viewing allowed.
        return {
            "id": self._permission_id,
            "object": "model_permission",
            "created": self.created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
