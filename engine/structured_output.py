"""Structured outputs: the output must be a JSON object (any, or one matching a schema), match
a regex, be one of a list of choices, follow an EBNF grammar, or follow a structural tag (free
text in which tagged spans, a tool call say, must hold to their own schemas).

xgrammar (the `structured` extra) does the grammar work, as in vLLM and SGLang: the grammar is
compiled against the tokenizer's vocabulary once per request (milliseconds, cached), each step a
per-sequence matcher marks the tokens that may come next (a bitmask; median 2–17 µs for SmolLM2's 49k
vocabulary), the sampler masks the others, and the sampled token advances the matcher. When the
grammar is complete only the EOS tokens remain allowed, so the sequence ends as it would freely.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# Whitespace between two JSON elements is free up to this run (a newline and 4-space indentation
# to depth 4, 2-space to depth 9), so a model cannot spend its whole budget on whitespace: small
# models fall into that loop under an unbounded grammar (the tests' tiny random model does).
_MAX_JSON_WHITESPACE = 20
_TYPES = {"json": ((dict, str), "a schema (an object or its JSON text)"), "json_object": (bool, "true or false"),
          "regex": (str, "a string"), "grammar": (str, "a string"),
          "structural_tag": ((dict, str), "a structural tag (an object or its JSON text)")}


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured outputs need xgrammar: pip install 'driftgate[structured]'") from None
    return xgrammar


def _reason(exc: RuntimeError) -> str:
    """xgrammar's message without its C++ source location ('[12:00:00] /project/cpp/x.cc:94: ')."""
    message = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", str(exc).strip())
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", message)


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """One constraint on a request's output (vLLM's `structured_outputs`); set exactly one field.

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex; choice: the output is
    one of these strings; grammar: EBNF in xgrammar's GBNF-like syntax (``root ::= ...``);
    structural_tag: vLLM's, as xgrammar reads it (dict or JSON text): ``{"type": "structural_tag",
    "format": {...}}``, or the older ``{"structures": [{"begin", "schema", "end"}, ...], "triggers":
    [...]}`` (text is free until a trigger starts a structure, whose content must match its schema).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(_KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        for kind, (types, what) in _TYPES.items():
            if getattr(self, kind) is not None and not isinstance(getattr(self, kind), types):
                raise ValueError(f"{kind} must be {what}")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        self.to_grammar()  # a bad schema, regex or grammar is refused here, before any engine sees it

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    def to_grammar(self):
        """The constraint as an xgrammar Grammar (independent of the tokenizer)."""
        grammar = _xgrammar().Grammar
        kind = self.kind
        try:
            if kind in ("json", "json_object"):  # json_object: OpenAI's JSON mode, an object (not any value)
                schema = self.json if kind == "json" else {"type": "object"}
                return _strict_json_strings(grammar.from_json_schema(
                    schema if isinstance(schema, str) else json.dumps(schema), max_whitespace_cnt=_MAX_JSON_WHITESPACE))
            if kind == "regex":
                return grammar.from_regex(self.regex)
            if kind == "choice":  # JSON string literals are valid EBNF literals, escapes included
                return grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in self.choice))
            if kind == "structural_tag":
                return _strict_json_strings(_structural_tag_grammar(self.structural_tag))
            return grammar.from_ebnf(self.grammar)
        except RuntimeError as exc:
            raise ValueError(f"{kind}: {_reason(exc)}") from None


# xgrammar (0.2) writes the characters of a string with minLength/maxLength as [^"\\\r\n], which
# admits raw control characters (invalid JSON: a tiny model wrote "\x1a" and finished 'stop'), where
# its other strings exclude them as JSON does
_LOOSE_STRING_CHARACTERS = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARACTERS = '[^\\0-\\x1f\\"\\\\]'


def _strict_json_strings(grammar):
    """The grammar with every JSON string's characters those JSON allows unescaped."""
    text = str(grammar)
    if _LOOSE_STRING_CHARACTERS not in text:
        return grammar
    return type(grammar).from_ebnf(text.replace(_LOOSE_STRING_CHARACTERS, _JSON_STRING_CHARACTERS))


def _structural_tag_grammar(tag: dict[str, Any] | str):
    """xgrammar's grammar for a structural tag, in either of the forms vLLM accepts."""
    xgr = _xgrammar()
    try:
        spec = json.loads(tag) if isinstance(tag, str) else tag
    except json.JSONDecodeError as exc:
        raise ValueError(f"structural_tag is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError("structural_tag must be an object")
    if "structures" not in spec:
        return xgr.Grammar.from_structural_tag(spec)
    structures, triggers = spec["structures"], spec.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise ValueError("structural_tag: structures and triggers must be non-empty lists")
    items = []
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict) or not {"begin", "end"} <= set(structure):
            raise ValueError(f"structural_tag: structures[{i}] needs begin and end")
        schema = structure.get("schema", {})
        items.append(xgr.StructuralTagItem(begin=structure["begin"], end=structure["end"],
                                           schema=schema if isinstance(schema, str) else json.dumps(schema)))
    return xgr.Grammar.from_structural_tag(items, triggers)


class GrammarCompiler:
    """Compiles constraints against one tokenizer; the vocabulary's facts are built on first use
    (~0.1 s for SmolLM2), so engines that never see a constraint never pay for them.

    Compiled grammars are cached (a schema sent again compiles in microseconds) up to
    `cache_limit_bytes`, least recently used out first: each distinct schema or tool set holds
    ~2.5 MB on SmolLM2's vocabulary, so a server whose clients send fresh schemas grew by gigabytes
    a day with xgrammar's unbounded default. vLLM bounds it alike (512 MiB)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], cache_limit_bytes: int = 512 * 2**20):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._cache_limit_bytes = cache_limit_bytes
        self._compiler = None
        self._lock = threading.Lock()  # requests are made on the callers' threads

    def compile(self, spec: StructuredOutputs):
        xgr = _xgrammar()
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._eos_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=self._cache_limit_bytes)
        return self._compiler.compile_grammar(spec.to_grammar())

    def cache_size_bytes(self) -> int:
        """What the compiled grammars kept for reuse hold now."""
        return self._compiler.get_cache_size_bytes() if self._compiler is not None else 0


def new_matcher(compiled_grammar):
    """A sequence's own position in its grammar."""
    return _xgrammar().GrammarMatcher(compiled_grammar)


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list) -> None:
    """Set to -inf, in place, every token that the matcher of logits row rows[j] does not allow next."""
    xgr = _xgrammar()
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for row, matcher in zip(rows, matchers, strict=True):
        matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
