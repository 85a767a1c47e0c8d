"""What a server needs from an engine: one `AsyncEngine`, or a `ClusterEngine` over many.

Both run their work off the caller's event loop (the engine's step thread; the router's own
loop thread), so a server drives either through the same calls and never branches on which.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.lora import LoRARequest


class ServingEngine(Protocol):
    tokenizer: Any  # a Hugging Face tokenizer
    max_model_len: int
    max_logprobs: int  # most logprobs alternatives a request may ask for
    eos_token_ids: list[int]  # every id that ends a sequence

    @property
    def is_alive(self) -> bool:
        """False once it stopped (or, for a cluster, while no replica answers)."""
        ...

    def start(self) -> None:
        """Begin serving; returns once requests can be accepted."""
        ...

    def shutdown(self) -> None:
        """Stop; requests still running end with an `EngineError`."""
        ...

    def stats(self) -> EngineStats:
        """The latest snapshot; never blocks on the engine."""
        ...

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 request_id: str, priority: int = 0, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs until finished; ValueError before the first one for a bad request
        (a non-zero `priority` included, unless the engine schedules by priority; a `lora` adapter
        name the engine did not load)."""
        ...

    async def add_lora(self, request: LoRARequest) -> None:
        """Load a LoRA adapter requests may then name (every replica of a cluster); ValueError says why not."""
        ...

    async def remove_lora(self, name: str) -> None:
        """Unload a LoRA adapter no request in flight uses; ValueError says why not."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop computing a request and free its KV (thread-safe; its stream need not end)."""
        ...
