"""Non-streaming requests end when their client leaves, as streams do: the work runs beside a
listener for the client's http.disconnect, and whichever ends first cancels the other. The
cancelled work closes its request streams, which aborts them in the engine and frees their KV."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself cancelled (server shutting down)
        task.cancel()
        raise
    finally:
        listener.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # nobody is left to tell
        await task
    raise ClientDisconnected


async def _disconnected(request: Request) -> None:
    # The body has been read; the next message the server hands us is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
