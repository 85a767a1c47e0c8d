"""Engine logprob dicts → the two OpenAI shapes (legacy completions, chat `content` list).

Logprobs are clamped at -9999 because JSON has no -inf, and masked tokens (top-k/top-p)
would otherwise make the whole response unencodable.
"""

from __future__ import annotations

import codecs
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
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
    """Per-token strings as clients expect them (`decode([id])`), and each token's own bytes
    (OpenAI's `bytes`: where a character is split over tokens, so are its bytes, which the
    string, decoded alone, shows as U+FFFD), cached per tokenizer."""

    def __init__(self, tokenizer) -> None:
        self._decode = lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))
        self.raw_bytes = lru_cache(maxsize=65536)(functools.partial(
            token_bytes, tokenizer, _byte_level(tokenizer), frozenset(tokenizer.added_tokens_decoder)))
        self.special = frozenset(tokenizer.all_special_ids)

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


def _byte_level(tokenizer) -> bool:
    """Whether the tokenizer's pieces spell bytes in GPT-2's printable alphabet (Llama 3, Qwen, SmolLM2)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()  # its JSON, a Sequence's parts too


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet (transformers' own table), inverted."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def token_bytes(tokenizer, byte_level: bool, added: frozenset[int], token_id: int) -> bytes:
    """The bytes one token stands for: a byte-level piece mapped back through its alphabet, a
    byte-fallback piece's byte, a SentencePiece word with its space; else its decoded text."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:
        return b""
    is_added = token_id in added  # added tokens keep their text as it is
    if byte_level and not is_added and all(ch in _byte_of_char() for ch in piece):
        return bytes(_byte_of_char()[ch] for ch in piece)
    if match := _BYTE_PIECE.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    if not is_added and piece.startswith("▁"):
        return piece.replace("▁", " ").encode()
    return tokenizer.decode([token_id]).encode()


def token_ids_as_text(token_id: int) -> str:
    """vLLM's `return_tokens_as_token_ids` form: exact even where a token's text is not unique."""
    return f"token_id:{token_id}"


@dataclass(frozen=True, slots=True)
class TokenNamer:
    """How logprob entries name one request's tokens, with the tokens' own bytes and which are
    special (text that skips special tokens has none of theirs)."""

    name: Callable[[int], str]
    raw_bytes: Callable[[int], bytes]
    special: frozenset[int] = frozenset()

    def __call__(self, token_id: int) -> str:
        return self.name(token_id)


def token_namer(text: TokenText, as_ids: bool) -> TokenNamer:
    """How logprob entries name tokens for one request."""
    return TokenNamer(token_ids_as_text if as_ids else text, text.raw_bytes, text.special)


def _ranked(entries: LogprobsDict, top_n: int) -> list[tuple[int, float]]:
    """The entries by logprob, ties in the engine's rank order; the first `top_n` (-1: all, the
    whole vocabulary asked for)."""
    ranked = sorted(entries.items(), key=lambda kv: (-kv[1], getattr(kv[1], "rank", 0)))
    return ranked if top_n == -1 else ranked[:top_n]


def completion_logprobs(
    text: TokenNamer,
    token_ids: list[int],
    entries: list[LogprobsDict | None],
    top_n: int,
    text_offset: int = 0,
    skip_special_tokens: bool = True,
) -> CompletionLogprobs:
    """The legacy shape; a `None` entry (the first prompt token) gives `null` logprobs there.

    `top_logprobs` holds the top `top_n` plus the actual token, as OpenAI and vLLM return it
    and as lm-eval's greedy check expects. `text_offset` counts a special token's text only where
    the output shows it (`skip_special_tokens` off): an echoed prompt's BOS is not in its text.
    """
    out = CompletionLogprobs()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a split character counts where it completes
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = text(token_id)
        out.tokens.append(token)
        out.text_offset.append(text_offset)
        if not skip_special_tokens or token_id not in text.special:
            text_offset += len(utf8.decode(text.raw_bytes(token_id)))
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
        for place, (t, lp) in enumerate(_ranked(entry, top_n), start=1):  # the token among them: its place (vLLM's)
            listed[t] = PromptLogprob(logprob=_clamp(lp), rank=place, decoded_token=text(t))
        out.append(listed)
    return out


def chat_logprobs(text: TokenNamer, token_ids: list[int], entries: list[LogprobsDict], top_n: int) -> ChatLogprobs:
    """The chat shape: one item per generated token with its top `top_n` alternatives."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = text(token_id)
        top = [TopLogprob(token=text(t), logprob=_clamp(lp), bytes=list(text.raw_bytes(t)))
               for t, lp in _ranked(entry, top_n)]
        content.append(TokenLogprob(token=token, logprob=_clamp(entry[token_id]),
                                    bytes=list(text.raw_bytes(token_id)), top_logprobs=top))
    return ChatLogprobs(content=content)
