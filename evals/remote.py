"""The candidate arm over HTTP: gate what is actually deployed, not a local copy of it.

`driftgate gate --server URL` scores Tier 1 through lm-eval's own `local-completions`
client (echo + logprobs on /v1/completions, the path any OpenAI-compatible server offers)
and Tier 2 through plain greedy completions. Tier 0 needs full-vocabulary logits, which no
OpenAI-style endpoint returns, so it is skipped in this mode and the report says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from lm_eval.api.registry import register_model
from lm_eval.models.openai_completions import LocalCompletionsAPI

from evals.lm_eval_model import GenerationRecord
from server.client import api_base, auth_headers, error_message, model_cards

_ID_PREFIX = "token_id:"
TIER0_SKIP_REASON = "candidate served over HTTP: an OpenAI-style server returns top-k logprobs only, Tier 0 needs all"


class ServerError(RuntimeError):
    """The server could not be used for the candidate arm; the message says why."""


def server_model(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> dict:
    """The first model card the server lists (`id`, and `max_model_len` where the server says)."""
    try:
        return model_cards(api_base(base_url), api_key, timeout)[0]
    except ValueError as exc:
        raise ServerError(str(exc)) from None


@register_model("driftgate-server")
class ServerLM(LocalCompletionsAPI):
    """lm-eval's `local-completions`, also keeping which generations ran into the token limit.

    lm-eval's string API drops finish reasons; the gate needs them for its runaway-rate
    check, as the in-process adapter provides. Requests are sent in batches (one HTTP call
    carries `batch_size` prompts) so the server's continuous batching has work to batch.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.generations: dict[str, GenerationRecord] = {}

    def parse_generations(self, outputs: dict | list[dict], contexts: Sequence[str] | None = None,
                          **kwargs) -> list[str]:
        texts = super().parse_generations(outputs)
        if contexts is not None:
            choices = [c for out in (outputs if isinstance(outputs, list) else [outputs])
                       for c in sorted(out["choices"], key=lambda c: c["index"])]
            for context, choice in zip(contexts, choices, strict=False):
                self.generations[context] = GenerationRecord(
                    token_ids=(), finish_reason=choice.get("finish_reason"),
                    hit_max_tokens=choice.get("finish_reason") == "length")
        return texts


def server_lm(base_url: str, model: str, tokenizer_dir: str, max_length: int, api_key: str | None = None,
              batch_size: int = 32) -> ServerLM:
    """The lm-eval model for a server, tokenizing locally with the candidate's own tokenizer."""
    return ServerLM(
        model=model,
        base_url=api_base(base_url) + "/completions",
        tokenizer=tokenizer_dir,
        tokenizer_backend="huggingface",
        batch_size=batch_size,
        num_concurrent=1,  # the synchronous path is the one that hands contexts to parse_generations
        max_retries=2,
        max_length=max_length,
        header=auth_headers(api_key) or None,
        timeout=600,
    )


def _token_ids(choice: dict) -> list[int] | None:
    """Exact ids from vLLM-style `token_id:N` logprob tokens; None when the server ignored the request."""
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    ids = [int(t[len(_ID_PREFIX):]) for t in tokens if isinstance(t, str) and t.startswith(_ID_PREFIX)
           and t[len(_ID_PREFIX):].isdigit()]
    return ids if tokens and len(ids) == len(tokens) else None


def greedy_generations(base_url: str, model: str, prompts: Sequence[list[int]], max_new_tokens: int,
                       tokenizer, api_key: str | None = None,
                       timeout: float = 1800.0) -> tuple[list[list[int]], bool]:
    """Greedy continuations from the server as token ids, and whether those ids are exact.

    Exact when the server honors vLLM's `return_tokens_as_token_ids` (ours does); otherwise
    the ids are the returned text re-encoded, and the caller must put the baseline's ids
    through the same decode/encode round trip (`ServedCandidate.comparable`) before comparing.
    `ignore_eos` (a vLLM extension that llama.cpp's server also takes) keeps lengths equal.
    """
    payload = {"model": model, "prompt": [list(p) for p in prompts], "max_tokens": max_new_tokens,
               "temperature": 0.0, "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    url = api_base(base_url) + "/completions"
    try:
        response = httpx.post(url, json=payload, headers=auth_headers(api_key), timeout=timeout)
    except httpx.HTTPError as exc:
        raise ServerError(f"greedy generations from {url} failed: {exc}") from exc
    if response.status_code != 200:
        raise ServerError(f"{url} answered HTTP {response.status_code}: {error_message(response)}")
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    if len(choices) != len(prompts):
        raise ServerError(f"{url} returned {len(choices)} completions for {len(prompts)} prompts")
    exact = [_token_ids(c) for c in choices]
    if all(ids is not None for ids in exact):
        return exact, True  # type: ignore[return-value]
    return [tokenizer.encode(c["text"], add_special_tokens=False) for c in choices], False


@dataclass(frozen=True, slots=True)
class ServedCandidate:
    """What the rest of a gate run needs to know about the server that produced the candidate arm."""

    url: str
    card: dict[str, Any]  # the server's /v1/models entry
    tokenizer: Any  # the candidate's own (Hugging Face) tokenizer
    exact_token_ids: bool  # False: Tier 2 ids are the served text re-encoded
    serves_candidate: bool | None  # the card names the --candidate folder or a copy of it; None: cannot tell

    def comparable(self, baseline_generations: Sequence[Sequence[int]]) -> list[list[int]]:
        """The baseline's Tier 2 ids as the candidate's came back: through the same decode/encode
        round trip when the server returned text, as they are when it returned ids."""
        if self.exact_token_ids:
            return [list(g) for g in baseline_generations]
        return [self.tokenizer.encode(self.tokenizer.decode(list(g)), add_special_tokens=False)
                for g in baseline_generations]

    def manifest(self) -> dict[str, Any]:
        return {"url": self.url, "model": self.card, "serves_candidate": self.serves_candidate,
                "exact_token_ids": self.exact_token_ids}
