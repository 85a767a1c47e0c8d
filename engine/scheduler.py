"""One token budget per step, no phases (vLLM v1's policy at nano-vllm size; no torch).

Each step: running requests first (decodes and unfinished prompt chunks), in arrival order,
each taking the tokens it still lacks up to the remaining budget; then, if nothing was
preempted, waiting requests in order, their prompts chunked to fit. When a running request
cannot get a block, the newest running request is preempted by recompute: its blocks are
freed (their hashes stay cached) and it goes to the front of the waiting queue.

Under a sliding window each running request first lets go of the blocks its window has left.

With `max_prefill_tokens_with_decodes` set, a step that decodes any sequence gives prompt
chunks at most that many tokens in all (Sarathi-Serve's stall-free batching): a long prompt
then costs every running stream a bounded stall per step instead of one long one.

With policy "priority" (vLLM's), both queues are kept in (priority, arrival) order, lower
values first: the waiting queue admits the most urgent request first, the running list gives it
the step's budget first, and the preemption victim (the last running) is the least urgent. A
waiting request that finds no seat or no blocks preempts running requests of a strictly lower
priority, the least urgent first, before the step is scheduled.
"""

from __future__ import annotations

import time
from bisect import insort
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.block_manager import Block, BlockManager
from engine.sequence import Request, RequestStatus

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    max_prefill_tokens_with_decodes: int = 0  # 0: prompt chunks are bounded by the step budget alone
    policy: str = "fcfs"  # or "priority": requests ordered by (priority, arrival)
    sliding_window: int | None = None  # the model's attention window: blocks before it are let go

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        if self.max_prefill_tokens_with_decodes < 0:
            raise ValueError("max_prefill_tokens_with_decodes must be 0 (no cap) or positive, "
                             f"got {self.max_prefill_tokens_with_decodes}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at its `start` (= computed count before the step).

    A decode with drafts (speculative decoding) feeds its last known token, then the drafts:
    num_tokens = 1 + len(draft_token_ids).
    """

    request: Request
    start: int
    num_tokens: int
    draft_token_ids: Sequence[int] = ()

    @property
    def is_decode(self) -> bool:
        """One known token (with or without drafts after it): the runner's decode kernels take it."""
        return self.num_tokens - len(self.draft_token_ids) == 1

    @property
    def completes_sequence(self) -> bool:
        """The chunk reaches the last known token, so the step samples a next token for it."""
        return self.start + self.num_tokens - len(self.draft_token_ids) == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0

    def add_request(self, request: Request) -> None:
        self._enqueue(self.waiting, request)

    def _enqueue(self, queue: deque[Request] | list[Request], request: Request, front: bool = False) -> None:
        """Into `queue` at its (priority, arrival) place under the priority policy; else at its back,
        or its front (a preempted request)."""
        if self.config.policy == "priority":
            insort(queue, request, key=_urgency)  # a preempted request's early arrival puts it first among peers
        elif front:
            queue.appendleft(request)
        else:
            queue.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.policy == "priority":
            self._preempt_for_urgent(out)
        num_preempted_for_urgent = len(out.preempted)
        budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_budget()
        i = 0
        window = self.config.sliding_window
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if window:  # this step's first query sees keys from num_computed_tokens - window + 1 on
                self.block_manager.release_before(request, request.num_computed_tokens - window + 1)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            chunk = self._decode_with_drafts(request, num_new, budget) if request.spec_token_ids else None
            if chunk is not None:
                out.chunks.append(chunk)
                budget -= chunk.num_tokens
                i += 1
                continue
            if num_new > 1:  # a prompt chunk
                num_new = min(num_new, prefill_budget)
                if num_new == 0:
                    i += 1
                    continue
                prefill_budget -= num_new
            while not self.block_manager.allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
                budget -= num_new
                i += 1
        if len(out.preempted) > num_preempted_for_urgent:
            return out
        while self.waiting and min(budget, prefill_budget) > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = self._prefix_hits(request)
            num_hit = len(hits) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_hit, budget, prefill_budget)
            if not self.block_manager.allocate(request, num_new, hits):
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:  # count each request's prompt once, not on resume
                request.num_cached_tokens = num_hit
                request.queue_time_s = time.monotonic() - request.arrival_time
                self.prefix_queries += request.num_tokens
                self.prefix_hits += num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self._enqueue(self.running, request)
            out.chunks.append(ScheduledChunk(request, num_hit, num_new))
            budget -= num_new
            prefill_budget -= num_new
        return out

    def _prefix_hits(self, request: Request) -> list[Block]:
        """The cached blocks a waiting request starts from."""
        hits = self.block_manager.get_computed_blocks(request)
        if request.params.prompt_logprobs is not None:
            # logits at position p score token p + 1: compute from prompt_logprobs_start − 1 on
            hits = hits[:max(request.params.prompt_logprobs_start - 1, 0) // self.block_manager.block_size]
        return hits

    def _preempt_for_urgent(self, out: SchedulerOutput) -> None:
        """Preempt the least urgent running requests while the most urgent waiting one, more urgent
        than they, has no seat or no blocks for its first chunk (vLLM's priority preemption).

        Only a strictly lower priority yields: peers would trade one recompute for another. Runs
        before anything is scheduled, so no victim has blocks allocated for this step.
        """
        if not self.waiting or not self.running or self.running[-1].priority <= self.waiting[0].priority:
            return
        head = self.waiting[0]
        hits = self._prefix_hits(head)
        num_uncached = head.num_tokens - len(hits) * self.block_manager.block_size
        while self.running and self.running[-1].priority > head.priority:
            if len(self.running) < self.config.max_num_seqs:
                num_new = min(num_uncached, self._prefill_budget())
                if self.block_manager.num_free_blocks_needed(head, num_new, hits) <= self.block_manager.num_free_blocks:
                    return
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)

    def _decode_with_drafts(self, request: Request, num_new: int, budget: int) -> ScheduledChunk | None:
        """The request's decode and its drafts (cut to the budget), or None, dropping the drafts,
        when it is not decoding or they find no room (its decode alone may still fit). Drafts never
        take the last blocks: no other sequence's next token is preempted for a guess."""
        drafts, request.spec_token_ids = request.spec_token_ids[:budget - 1], []
        if (not drafts or num_new != 1 or self.block_manager.num_free_blocks <= len(self.running)
                or not self.block_manager.allocate(request, 1, num_lookahead_tokens=len(drafts))):
            return None
        return ScheduledChunk(request, request.num_computed_tokens, 1 + len(drafts), drafts)

    def _prefill_budget(self) -> int:
        """Tokens prompt chunks may take this step: capped only while some sequence decodes."""
        cap = self.config.max_prefill_tokens_with_decodes
        if cap and any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running):
            return cap
        return self.config.max_num_batched_tokens

    def withdraw(self, requests: list[Request]) -> bool:
        """Take back requests never admitted (all or none), so a router can place them elsewhere.

        Only a request still waiting since it arrived qualifies: nothing computed, no blocks,
        nothing streamed. A preempted one was admitted once (it may have streamed) and stays.
        Frees nothing and leaves the requests WAITING, ready for another scheduler.
        """
        if not all(r.status is RequestStatus.WAITING and r.num_cached_tokens < 0 and r in self.waiting
                   for r in requests):
            return False
        for request in requests:
            self.waiting.remove(request)
        return True

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        self._enqueue(self.waiting, request, front=True)
        self.num_preemptions += 1

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance computed counts, append sampled tokens (one, or accepted drafts and one more),
        finish what hit EOS/stop ids/length; tokens after a finishing one are cut from `sampled`."""
        finished = []
        for chunk in out.chunks:
            request = chunk.request
            tokens = sampled.get(request.request_id, ())
            # KV is valid up to the last accepted draft; rejected drafts' slots are written over later
            num_accepted = len(tokens) - 1 if chunk.draft_token_ids else 0
            request.num_computed_tokens = chunk.start + chunk.num_tokens - len(chunk.draft_token_ids) + num_accepted
            for i, token in enumerate(tokens):
                request.append_token(token)
                status = self._check_stop(request, token)
                if status is not None:
                    self.finish(request, status)
                    finished.append(request)
                    del tokens[i + 1:]
                    break
        return finished

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        # before min_tokens the sampler lets a stop token through only where nothing else is allowed
        # (a complete grammar, allowed_token_ids): it ends the output then
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Finish (or abort) a request wherever it is; its blocks are freed at once."""
        if request.status.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = status


def _urgency(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time
