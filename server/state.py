"""What one app instance holds: the engine (once loaded), its phase, admission counts, metrics."""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.outputs import EngineStats
from server.config import ServerConfig
from server.errors import APIError
from server.logprobs import TokenText
from server.metrics import ServerMetrics

if TYPE_CHECKING:
    from engine.serving import ServingEngine


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


@dataclass(slots=True)
class RequestRecord:
    """Facts about one generation request, filled in as it runs, logged once when it ends."""

    request_id: str
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    outcome: str = "ok"  # ok | timeout | client_closed | error


class ServerState:
    """Shared by every route of one app; touched only from the event loop (no locks needed)."""

    def __init__(self, engine: ServingEngine | None, config: ServerConfig) -> None:
        self.config = config
        self.engine: ServingEngine | None = None
        self.token_text: TokenText | None = None
        self.phase = Phase.LOADING
        self.num_unstarted = 0  # admitted requests that have not produced a first token yet
        self.metrics = ServerMetrics(self.engine_stats)
        # finished /v1/responses (server.responses.StoredResponse) by id, oldest first
        self.responses: OrderedDict[str, Any] = OrderedDict()
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: ServingEngine) -> None:
        """Start serving on a loaded engine (the app answers 503 until then)."""
        self.engine = engine
        self.token_text = TokenText(engine.tokenizer)
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY

    def begin_drain(self) -> None:
        """Refuse new work with 503; requests already running continue."""
        self.phase = Phase.DRAINING

    def engine_stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    def ready_engine(self) -> ServingEngine:
        """The engine, or a 503 when it is not accepting work."""
        if self.phase is not Phase.READY or self.engine is None:
            raise APIError(503, f"server is {self.phase.value}; retry later",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        if not self.engine.is_alive:
            raise APIError(503, "engine loop is not running")
        return self.engine

    def admit(self) -> None:
        """Take a queue slot or fail with 429.

        The queue depth is our own count of admitted requests without a first token yet: exact
        even for a burst the engine has not seen, and in requests, as --max-queue says (the
        engine's waiting count is in sequences: one waiting n=8 request would fill a queue of 4).
        """
        depth = self.num_unstarted
        if depth >= self.config.max_queue:
            raise APIError(429, f"the waiting queue is full ({depth} requests); retry later",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        self.num_unstarted += 1

    def mark_started(self) -> None:
        """Give back the queue slot taken by `admit` (first token seen, or the request ended)."""
        self.num_unstarted -= 1
