"""Incremental detokenization and stop-string matching for one generated sequence."""

from __future__ import annotations

from collections.abc import Sequence

# prompt tokens the first output token is decoded after (vLLM's detokenizer takes as many)
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Decodes only a short window per new token, holding back incomplete UTF-8 sequences.

    Byte-level BPE can split one character over several tokens; decoding such a prefix yields
    U+FFFD, so new text is released only once the window decodes cleanly. The window starts on
    the prompt's last tokens, since a token's text can depend on what precedes it: SentencePiece
    decoders drop the leading space of a sequence's first "▁word", which after a prompt is a space.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Add one token; returns the text it released (possibly empty)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.text += new
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return new
        return ""


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_len` chars: (its start index, it)."""
    best = None
    for stop in stops:
        start_search = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, start_search)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
