"""A request as the scheduler and block manager see it (no torch)."""

from __future__ import annotations

import enum
import time

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Request:
    """Token state of one sequence: what is known, what is computed, where its KV lives."""

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "all_token_ids", "params",
                 "arrival_time", "status", "num_computed_tokens", "block_ids", "block_hashes",
                 "num_cached_tokens", "stop_reason", "grammar", "spec_token_ids",
                 "priority", "num_released_blocks", "lora", "lora_index", "queue_time_s")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, grammar=None, priority: int = 0,
                 lora: str | None = None, lora_index: int | None = None):
        if not prompt_token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_ids: list[int] = []
        self.num_released_blocks = 0  # leading block_ids a sliding window left behind (BlockManager.release_before)
        self.block_hashes: list[bytes] = []  # hashes of the full blocks of all_token_ids, in order
        self.num_cached_tokens = -1  # prefix-cache hit at first admission (-1: not yet admitted)
        self.queue_time_s: float | None = None  # arrival to first admission (None: not yet admitted)
        self.stop_reason: int | str | None = None
        self.grammar = grammar  # params.structured_outputs compiled for this tokenizer, or None
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next step (speculative decoding)
        self.priority = priority  # lower is more urgent; used by the "priority" scheduling policy
        self.lora, self.lora_index = lora, lora_index  # the LoRA adapter serving it (name, index), if any

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past `num_output_tokens` (a stop string ended the text earlier)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[-drop:]
            del self.all_token_ids[-drop:]

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_ids)}, {self.status.value})")
