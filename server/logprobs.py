"""Engine logprob dicts → the two OpenAI shapes (legacy completions, chat `content` list).

Logprobs are clamped at -9999 because JSON has no -inf, and masked tokens (top-k/top-p)
would otherwise make the whole response unencodable.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from engine.outputs import LogprobsDict
from server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)

_FLOOR = -9999.0


def _clamp(logprob: float) -> float:
    return logprob if logprob > _FLOOR else _FLOOR


class TokenText:
    """Per-token strings as clients expect them (`decode([id])`), cached per tokenizer."""

    def __init__(self, tokenizer) -> None:
        self._decode = lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


def token_ids_as_text(token_id: int) -> str:
    """vLLM's `return_tokens_as_token_ids` form: exact even where a token's text is not unique."""
    return f"token_id:{token_id}"


TokenNamer = Callable[[int], str]


def token_namer(text: TokenText, as_ids: bool) -> TokenNamer:
    """How logprob entries name tokens for one request."""
    return token_ids_as_text if as_ids else text


def _ranked(entries: LogprobsDict, top_n: int) -> list[tuple[int, float]]:
    return sorted(entries.items(), key=lambda kv: kv[1], reverse=True)[:top_n]


def completion_logprobs(
    text: TokenNamer,
    token_ids: list[int],
    entries: list[LogprobsDict | None],
    top_n: int,
    text_offset: int = 0,
) -> CompletionLogprobs:
    """The legacy shape; a `None` entry (the first prompt token) gives `null` logprobs there.

    `top_logprobs` holds the top `top_n` plus the actual token, as OpenAI and vLLM return it
    and as lm-eval's greedy check expects.
    """
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = text(token_id)
        out.tokens.append(token)
        out.text_offset.append(text_offset)
        text_offset += len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_clamp(entry[token_id]))
        top = {text(t): _clamp(lp) for t, lp in _ranked(entry, top_n)}
        top.setdefault(token, _clamp(entry[token_id]))
        out.top_logprobs.append(top)
    return out


def prompt_logprobs(text: TokenNamer, prompt_ids: list[int], entries: list[LogprobsDict | None],
                    top_n: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token (the first has none) the token itself and the
    top `top_n`, keyed by id, each with its logprob, rank and text."""
    out: PromptLogprobs = []
    for token_id, entry in zip(prompt_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        listed = {token_id: PromptLogprob(logprob=_clamp(entry[token_id]), rank=entry[token_id].rank,
                                          decoded_token=text(token_id))}
        for place, (t, lp) in enumerate(_ranked(entry, top_n), start=1):
            listed.setdefault(t, PromptLogprob(logprob=_clamp(lp), rank=place, decoded_token=text(t)))
        out.append(listed)
    return out


def chat_logprobs(text: TokenNamer, token_ids: list[int], entries: list[LogprobsDict], top_n: int) -> ChatLogprobs:
    """The chat shape: one item per generated token with its top `top_n` alternatives."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = text(token_id)
        top = [TopLogprob(token=text(t), logprob=_clamp(lp), bytes=list(text(t).encode()))
               for t, lp in _ranked(entry, top_n)]
        content.append(TokenLogprob(token=token, logprob=_clamp(entry[token_id]),
                                    bytes=list(token.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)
