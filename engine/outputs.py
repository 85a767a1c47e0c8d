"""What the engine hands back: vLLM-shaped request outputs and the plain stats object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar


class Logprob(float):
    """A logprob that is also vLLM's `Logprob` record: `.logprob`, `.rank` (1 = the position's most
    probable token) and `.decoded_token` (the offline LLM fills it in). Arithmetic, comparisons
    and JSON take it as the float it is, so code written for plain floats keeps working."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        value = super().__new__(cls, logprob)
        value.rank = rank
        value.decoded_token = decoded_token
        return value

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


# One position's logprobs: token id -> logprob (the chosen/actual token always included).
LogprobsDict = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One sampled sequence of a request (index < n)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobsDict] | None = None  # one dict per generated token
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    cumulative_logprob: float | None = None  # the sum of its tokens' logprobs (with logprobs, or beam search)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's state: cumulative outputs; `finished` once every sequence is done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # One entry per prompt token; the first is None (nothing precedes it).
    prompt_logprobs: list[LogprobsDict | None] | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's pooled final hidden state (not normalized)
    queue_time_s: float | None = None  # arrival to first admission in the engine's queue (None: still waiting)

    @property
    def prompt_logprob_ranks(self) -> list[int | None] | None:
        """Each prompt token's rank in its row (1 = the most probable; None where no logprob)."""
        if self.prompt_logprobs is None:
            return None
        return [None if entry is None else entry[token].rank
                for token, entry in zip(self.prompt_token_ids, self.prompt_logprobs, strict=True)]


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class ScoringOutput:
    score: float


PooledResult = TypeVar("PooledResult")


@dataclass(slots=True)
class PoolingRequestOutput(Generic[PooledResult]):
    """One input's result from LLM.embed / classify / score, in vLLM's shape: under `.outputs`
    (an EmbeddingOutput, a ClassificationOutput or a ScoringOutput)."""

    request_id: str
    outputs: PooledResult
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class EngineStats:
    """Counters for metrics endpoints and benchmarks (a snapshot, cheap to build)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks_total: int = 0
    num_blocks_used: int = 0
    num_blocks_free: int = 0
    num_blocks_cached: int = 0  # free blocks that still hold a hash (hittable, but for duplicates of a cached one)
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens served from the cache
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # tokens prefilled (computed, excluding cache hits)
    num_generation_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts verified
    num_accepted_draft_tokens: int = 0  # ... and kept by the sampler
    # LoRA adapters the running and the waiting requests name (vLLM's lora_requests_info, which
    # LoRA-aware gateways read to send a request where its adapter is already loaded)
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0  # adapters that may be in use at once (0: LoRA off)
    extra: dict[str, float] = field(default_factory=dict)
    cluster: ClusterStats | None = None  # set by a cluster: the counters above are its replicas' sums

    @property
    def kv_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total if self.num_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(slots=True)
class ReplicaStats:
    """One replica of a cluster, as of its last report to the router."""

    replica_id: int
    is_alive: bool
    num_dispatched: int  # requests the router sent it (a migrated request counts at each replica)
    stats: EngineStats


@dataclass(slots=True)
class ClusterStats:
    """What only a cluster has: per-replica stats and the router's own queue."""

    replicas: list[ReplicaStats]
    num_queued: int  # requests in the router's global queue, not on any replica yet
    num_migrated: int  # requests withdrawn from one replica unstarted and routed again
