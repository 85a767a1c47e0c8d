"""One engine replica as a Ray actor: an `AsyncEngine` plus what the router reads from it.

The actor streams each request's outputs as they are produced (a Ray streaming generator, so the
API process never waits for a whole response), hands the router its KV events and engine stats
on every `report()`, and gives back requests it has not started when the router migrates them. Launching places replicas with Ray's SPREAD strategy, so they land
on different nodes when the cluster has them.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import ray

from engine.async_engine import AsyncEngine
from engine.block_manager import KVEvent
from engine.config import EngineConfig
from engine.lora import LoRARequest
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """KV events since the last report, and load as of the engine's last step."""

    incarnation: str  # new on every (re)start: a restarted replica's seq starts again at 1
    events: list[KVEvent]
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class ReplicaShape:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    eos_token_ids: list[int]
    max_logprobs: int
    lora_paths: dict[str, str] = field(default_factory=dict)  # the LoRA adapters it loaded: name → folder


class Replica:
    """Actor body (wrapped by `ray.remote` in `launch_replicas`)."""

    def __init__(self, config: EngineConfig):
        self.refused: ValueError | None = None
        try:
            self.engine = AsyncEngine(dataclasses.replace(config, record_kv_events=True))
        except ValueError as exc:  # a setting or checkpoint it refuses: `shape` says why, not Ray's traceback
            self.refused = exc
            return
        self.engine.start()
        self._block_manager = self.engine.engine.block_manager
        self._last_reported_seq = 0
        self.incarnation = uuid.uuid4().hex

    def shape(self) -> ReplicaShape:
        if self.refused is not None:
            raise self.refused
        lora = self.engine.engine.lora
        return ReplicaShape(self._block_manager.num_blocks, self._block_manager.block_size,
                            self.engine.config.max_num_seqs, self.engine.max_model_len, self.engine.eos_token_ids,
                            self.engine.max_logprobs, dict(lora.paths) if lora is not None else {})

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(prompt_token_ids, params, request_id, priority, lora):
            yield out

    async def add_lora(self, request: LoRARequest) -> None:
        await self.engine.add_lora(request)

    async def remove_lora(self, name: str) -> None:
        await self.engine.remove_lora(name)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def withdraw(self, request_id: str) -> bool:
        """Give back a request not started yet (its `generate` stream then ends without output)."""
        return await self.engine.withdraw(request_id)

    def report(self) -> ReplicaReport:
        events = self._block_manager.drain_events()  # a swap: safe against the engine thread
        if events:
            self._last_reported_seq = events[-1].seq
        return ReplicaReport(self.incarnation, events, self.engine.stats())

    def snapshot(self) -> tuple[set[bytes], int]:
        """Cached hashes, labelled with the last seq already reported.

        Events after that seq may already be reflected in the set; replaying them onto it is
        harmless (each store/remove/clear is idempotent), so the router converges.
        """
        # set(dict) runs in C under the GIL: the engine thread cannot mutate mid-copy
        return set(self._block_manager.cached), self._last_reported_seq


def gpus_per_replica(device: str, num_replicas: int, cluster_gpus: float) -> int:
    """One GPU for each replica on CUDA, none on CPU.

    Ray shows an actor only the GPUs it asked for (it sets CUDA_VISIBLE_DEVICES, to nothing
    for an actor that asked for none), so a CUDA replica must ask for its own; and replicas
    that would wait for GPUs the cluster does not have are refused up front, not left pending.
    """
    if device == "cpu":
        return 0
    if cluster_gpus < num_replicas:
        raise ValueError(f"{num_replicas} replicas on {device} need {num_replicas} GPUs, one each; the Ray cluster "
                         f"has {cluster_gpus:g} (fewer --replicas, more GPU nodes, or --device cpu)")
    return 1


def launch_replicas(config: EngineConfig, num_replicas: int, num_cpus: float = 1.0) -> list[ray.actor.ActorHandle]:
    """Start `num_replicas` replica actors, spread across the Ray cluster's nodes.

    Ray restarts a replica that dies (forever); calls in flight fail rather than being retried,
    because only the caller knows whether a stream already sent tokens. Replica i's engine is
    seeded with `config.seed + i`.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    num_gpus = gpus_per_replica(config.device, num_replicas, ray.cluster_resources().get("GPU", 0.0))
    if num_gpus:
        config = dataclasses.replace(config, device="cuda")  # its one visible GPU, whatever cuda:N said
    actor = ray.remote(Replica).options(num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy="SPREAD",
                                        max_restarts=-1, max_task_retries=0)
    # unseeded sampling draws from the engine's generator: replicas seeded alike would give two such
    # requests landing on different replicas the same tokens
    return [actor.remote(dataclasses.replace(config, seed=config.seed + i)) for i in range(num_replicas)]
