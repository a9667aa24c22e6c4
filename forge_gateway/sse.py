"""The gateway's gRPC calls as HTTP answers: a client that disconnects cancels its calls, and the
server streams of one request become one SSE response (chunks, then `[DONE]`; a failure after the
first chunk is one `error` event)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from fastapi import Request

from forge_gateway import streams
from forge_gateway.errors import GatewayError, from_grpc, internal_error
from forge_service.pb import forge_pb2 as pb

log = logging.getLogger(__name__)

CLOSED_BY_CLIENT = 499  # nginx's code; nobody reads it, the client is gone


class ClientDisconnected(Exception):
    """The HTTP client went away; its gRPC calls were cancelled."""


async def unless_disconnected(request: Request, awaitable: Awaitable[Any], cancel: Callable[[], None]) -> Any:
    """Await gRPC work; `cancel` its calls if the HTTP client disconnects first or it fails."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
    except BaseException:
        cancel()
        raise
    finally:
        watcher.cancel()
    cancel()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
        await work
    log.info("client disconnected; cancelled its gRPC calls")
    raise ClientDisconnected()


def canceller(calls: list[Any]) -> Callable[[], None]:
    def cancel() -> None:
        for call in calls:
            call.cancel()

    return cancel


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merge(calls: list[Any]) -> AsyncIterator[tuple[int, pb.StreamResponse]]:
    """(prompt index, message) from several server streams as they arrive; cancels them on exit."""
    if len(calls) == 1:  # one prompt (nearly every request): read it directly, no task and queue per message
        try:
            async for message in calls[0]:
                yield 0, message
        finally:
            calls[0].cancel()
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, call: Any) -> None:
        try:
            async for message in call:
                await queue.put((index, message))
            await queue.put((index, None))
        except Exception as error:  # handed to the consumer, which raises it
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(i, call)) for i, call in enumerate(calls)]
    try:
        remaining = len(calls)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for call in calls:
            call.cancel()
        for task in tasks:
            task.cancel()


def _event(payload: dict[str, Any], event: str | None = None) -> str:
    name = f"event: {event}\n" if event else ""
    return f"{name}data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def events(first: tuple[int, pb.StreamResponse], rest: AsyncIterator[tuple[int, pb.StreamResponse]],
                 formatter: streams.StreamFormatter) -> AsyncIterator[str]:
    """The stream's chunks, then `[DONE]` (a Responses stream: events named by their type, and no
    `[DONE]`); a failure after the first chunk is one `error` event (OpenAI error JSON) that ends
    the stream without `[DONE]`."""
    def event(chunk: dict[str, Any]) -> str:
        return _event(chunk, chunk["type"] if formatter.named_events else None)

    try:
        for chunk in formatter.start(first[1]) + formatter.on_message(*first):
            yield event(chunk)
        async for index, message in rest:
            for chunk in formatter.on_message(index, message):
                yield event(chunk)
        for chunk in formatter.end():
            yield event(chunk)
    except Exception as error:
        yield _event(_error(error).body(), "error")
        return
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
    if formatter.done_marker:
        yield "data: [DONE]\n\n"


def _error(error: Exception) -> GatewayError:
    if isinstance(error, GatewayError):  # e.g. a completion the server aborted
        return error
    if isinstance(error, grpc.aio.AioRpcError):
        return from_grpc(error)
    return internal_error(error)  # a bug mid-stream: reported in the stream, with an id
