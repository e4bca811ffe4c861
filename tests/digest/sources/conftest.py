from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from digest.sources.polite_http import PoliteClient, PoliteHttpConfig
from tests.digest.sources.scripted_server import ScriptedServer

MakeClient = Callable[..., PoliteClient]


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with ScriptedServer() as running:
        yield running


@pytest.fixture
def make_client() -> Iterator[MakeClient]:
    """Clients whose waits are milliseconds unless a test asks otherwise, closed afterwards."""
    made: list[PoliteClient] = []

    def make(**overrides: float) -> PoliteClient:
        settings: dict[str, float] = dict(
            min_interval_s=0.0, max_retries=2, backoff_s=0.01, max_backoff_s=2.0, timeout_s=5.0
        )
        settings.update(overrides)
        config = PoliteHttpConfig(**settings)  # type: ignore[arg-type]
        made.append(PoliteClient(config))
        return made[-1]

    yield make
    for polite in made:
        polite.close()


@pytest.fixture
def client(make_client: MakeClient) -> PoliteClient:
    return make_client()
