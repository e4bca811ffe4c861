"""Embeddings from any OpenAI-compatible `/v1/embeddings` endpoint, for the ranking's optional
similarity term (digest/ranking.py).

Synchronous and small on purpose: it runs once per night, before the model calls, over the
night's papers and the profile's tagged ones, in batches of `batch_size` texts (one request each,
so the request count is bounded by the texts' count). A failure raises EmbeddingError; the
ranking then goes on without embeddings rather than failing the night."""

from __future__ import annotations

import os
from dataclasses import dataclass

import httpx
import numpy as np


class EmbeddingError(RuntimeError):
    """The endpoint did not give one vector per text."""


@dataclass(slots=True)
class EmbeddingsConfig:
    base_url: str  # ".../v1"
    model: str
    api_key_env: str | None = None
    batch_size: int = 64
    timeout_s: float = 60.0
    max_chars: int = 4000  # per text: titles and abstracts fit, a stray huge field does not

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


def embed_texts(config: EmbeddingsConfig, texts: list[str]) -> np.ndarray:
    """One row per text, in order."""
    headers = {"Authorization": f"Bearer {key}"} if (key := config.api_key()) else {}
    url = config.base_url.rstrip("/") + "/embeddings"
    rows: list[list[float]] = []
    with httpx.Client(timeout=config.timeout_s, headers=headers) as client:
        for start in range(0, len(texts), config.batch_size):
            batch = [t[: config.max_chars] for t in texts[start : start + config.batch_size]]
            rows += _request(client, url, config.model, batch)
    matrix = np.asarray(rows, dtype=np.float64)
    if matrix.ndim != 2 or not np.isfinite(matrix).all():
        raise EmbeddingError(f"{url}: vectors of unequal length or not finite")
    return matrix


def _request(client: httpx.Client, url: str, model: str, batch: list[str]) -> list[list[float]]:
    try:
        response = client.post(url, json={"model": model, "input": batch})
    except httpx.HTTPError as exc:
        raise EmbeddingError(f"{url}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise EmbeddingError(f"{url}: HTTP {response.status_code}: {response.text[:200]}")
    try:
        data = sorted(response.json()["data"], key=lambda d: d["index"])
        vectors = [list(map(float, d["embedding"])) for d in data]
    except (ValueError, KeyError, TypeError) as exc:
        raise EmbeddingError(f"{url}: not an embeddings response ({exc})") from None
    if len(vectors) != len(batch):
        raise EmbeddingError(f"{url}: {len(vectors)} vectors for {len(batch)} texts")
    return vectors
