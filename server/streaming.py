"""Server-sent events for both generation routes.

The first output is awaited *before* the response starts, so an invalid prompt or a timeout
while queued still gets a real 400/504 status; after that, errors travel as an SSE event
carrying the usual error body, followed by `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from engine.outputs import RequestOutput
from server.errors import APIError, error_body
from server.generation import Generation, until_disconnect
from server.state import RequestRecord

Render = Callable[[int, RequestOutput], list[BaseModel]]


def sse(payload: BaseModel | dict, event: str | None = None) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n" if event is None else f"event: {event}\ndata: {data}\n\n"


async def stream_response(
    request: Request,
    generation: Generation,
    record: RequestRecord,
    render: Render,
    finish: Callable[[], list[BaseModel]],
    typed_events: bool = False,
    error_payload: Callable[[int, str, str | None], dict] = error_body,
) -> StreamingResponse:
    """Start streaming once the first output exists; `generation` is closed however it ends.

    Args:
        render: the chunks for one new output (may be empty when nothing visible changed).
        finish: the chunks after the last output (the usage chunk, when asked for).
        typed_events: the Responses and Messages APIs' streams: each event named by its `type`, no `[DONE]`.
        error_payload: the body of an error event (OpenAI's shape unless the API has its own).
    """
    def send(chunk: BaseModel | dict) -> str:
        return sse(chunk, chunk["type"] if typed_events else None)

    outputs = generation.outputs()
    try:
        first = await until_disconnect(anext(outputs), request.receive, record)
    except BaseException:
        await generation.aclose()
        raise

    async def events() -> AsyncIterator[str]:
        try:
            for chunk in render(*first):
                yield send(chunk)
            async for index, out in outputs:
                for chunk in render(index, out):
                    yield send(chunk)
            for chunk in finish():
                yield send(chunk)
        except APIError as exc:
            yield sse(error_payload(exc.status, exc.message, exc.param), "error" if typed_events else None)
        finally:
            await generation.aclose()
        if not typed_events:
            yield "data: [DONE]\n\n"

    # The background task also closes the generation when starlette drops the body iterator
    # while it is parked at a `yield` (client gone during a send), where `finally` won't run yet.
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(generation.aclose))
