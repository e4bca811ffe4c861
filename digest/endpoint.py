"""Where the digest's model calls go: `local` starts `nightshift serve` with the default model on a
free loopback port for the length of the run; a URL is any OpenAI-compatible server, ours or a
cloud one, used unchanged (a `nightshift router` in front of replicas too); several URLs
(`--endpoint URL1,URL2`) are servers of the same model used as one, a paper's calls kept on one
of them (endpoint_pool.py). A repeated --endpoint still means the last one, as it always did."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from engine.model_fetch import resolve_model
from engine.server.server_process import start_server_process

log = logging.getLogger(__name__)

LOCAL = "local"


class EndpointError(ValueError):
    """The endpoint options do not make sense (e.g. a URL without --model)."""


# The runs and calls tables keep an endpoint in 500 characters.
LABEL_CHARS = 500


@dataclass(slots=True, frozen=True)
class Endpoint:
    base_url: str  # the one URL, or the label of several
    model: str
    api_key: str | None
    base_urls: tuple[str, ...] = ()  # each of several endpoints; empty: base_url alone


def endpoint_urls(endpoint: str) -> list[str]:
    """The URLs of --endpoint: one, or several comma-separated."""
    return [u.strip().rstrip("/") for u in endpoint.split(",") if u.strip()]


def endpoints_label(urls: list[str]) -> str:
    label = ",".join(urls)
    if len(label) <= LABEL_CHARS:
        return label
    return f"{urls[0]} and {len(urls) - 1} more"[:LABEL_CHARS]


def local_model_name(local_model: str) -> str:
    """The name the local server is given: the model folder's name (the default model's is
    `SmolLM2-135M-Instruct`), so stored results say which weights produced them."""
    return Path(resolve_model(local_model)).name


def api_key_from_env(var: str | None) -> str | None:
    if var is None:
        return None
    key = os.environ.get(var)
    if not key:
        raise EndpointError(f"--api-key-env names {var}, but that environment variable is empty")
    return key


def check_endpoint(
    endpoint: str, model: str | None, api_key_env: str | None, local_model: str = "default"
) -> tuple[str, str]:
    """Validate the endpoint options before any work; returns (model name, endpoint label)."""
    if endpoint == LOCAL:
        return model or local_model_name(local_model), LOCAL
    urls = endpoint_urls(endpoint)
    if not urls:
        raise EndpointError("--endpoint names no URL")
    for url in urls:
        if url == LOCAL and len(urls) > 1:
            raise EndpointError("--endpoint local cannot be combined with URLs")
        check_url(url)
    if len(set(urls)) != len(urls):
        raise EndpointError("--endpoint names the same URL twice")
    if not model:
        raise EndpointError("--model is required with --endpoint URL (the server's model name)")
    api_key_from_env(api_key_env)
    return model, endpoints_label(urls)


def check_url(endpoint: str) -> None:
    """An http(s) URL with a host and a port from 1 to 65535; otherwise the client fails later,
    deep inside httpx or asyncio, with a traceback instead of a line."""
    bad = f"--endpoint must be 'local' or an http(s) URL, not {endpoint!r}"
    if not endpoint.startswith(("http://", "https://")):
        raise EndpointError(bad)
    try:
        parts = urlsplit(endpoint)
        host, port = parts.hostname, parts.port  # port: ValueError unless a number <= 65535
    except ValueError:
        raise EndpointError(f"{bad}: a bad host or port (1 to 65535)") from None
    if not host:
        raise EndpointError(f"{bad}: no host")
    if port == 0:
        raise EndpointError(f"{bad}: the port must be from 1 to 65535")


@contextmanager
def open_endpoint(
    endpoint: str,
    model: str | None,
    api_key_env: str | None,
    local_model: str = "default",
    local_args: tuple[str, ...] = (),
) -> Iterator[Endpoint]:
    name, label = check_endpoint(endpoint, model, api_key_env, local_model)
    if endpoint != LOCAL:
        urls = endpoint_urls(endpoint)
        several = tuple(urls) if len(urls) > 1 else ()
        yield Endpoint(label, name, api_key_from_env(api_key_env), several)
        return
    folder = str(resolve_model(local_model))
    log.info("starting a local nightshift server for %s", name)
    args = ["--model", folder, "--served-model-name", name, *local_args]
    with start_server_process(args, quiet=not log.isEnabledFor(logging.DEBUG)) as server:
        log.info("local server ready at %s", server.base_url)
        yield Endpoint(server.base_url, name, None)


def context_tokens(
    endpoint: str, model: str | None, api_key_env: str | None, local_model: str = "default"
) -> int | None:
    """The model's context length, when it can be known without loading the model: the local
    model's config, or the `max_model_len` that our server and vLLM list under /v1/models.
    None when the server does not say (cloud APIs)."""
    if endpoint == LOCAL:
        config = json.loads((Path(resolve_model(local_model)) / "config.json").read_text())
        return config.get("max_position_embeddings")
    headers = {}
    if key := (os.environ.get(api_key_env) if api_key_env else None):
        headers["Authorization"] = f"Bearer {key}"
    try:  # of several endpoints (one model), the first answers for all
        reply = httpx.get(f"{endpoint_urls(endpoint)[0]}/models", headers=headers, timeout=10)
        cards = reply.json().get("data", []) if reply.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    for card in cards:
        if isinstance(card, dict) and card.get("id") == model:
            length = card.get("max_model_len")
            return length if isinstance(length, int) else None
    return None
