"""Turn a validated request body into engine inputs: prompt token ids and `SamplingParams`.

Everything a client can get wrong is a 400 here, before the engine sees the request.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.beam_search import BeamSearchParams
from engine.sampling_params import SamplingParams
from engine.sampling_params import truncate_prompt as truncate_prompt_ids
from engine.structured_output import StructuredOutputs
from server.config import ServerConfig
from server.errors import APIError, ContextLengthError
from server.protocol import SamplingFields, StreamOptions, Usage

# fields that would change the output and that this server cannot honour: refused by name, never
# dropped (each route's body has its own subset of them)
_UNSUPPORTED = {
    "logits_processors": "logits_processors is not supported",
    "suffix": "suffix is not supported",
    "functions": "functions are not supported; send them as tools",
    "function_call": "function_call is not supported; send tool_choice",
    "audio": "audio output is not available: this server answers in text",
    "web_search_options": "web search is not available here",
    "chat_template": "a request's own chat_template is not accepted; the server's is set with --chat-template",
}


def apply_server_defaults(body: SamplingFields, config: ServerConfig) -> None:
    """Lay the server's request-field defaults over the body (serve --return-tokens-as-token-ids,
    --enable-force-include-usage): each turns a field on that the request left off."""
    if body.stream_options is not None and not body.stream:  # as vLLM: nothing would read them
        raise APIError(400, "stream_options is only for stream=true", param="stream_options")
    body.return_tokens_as_token_ids |= config.return_tokens_as_token_ids
    if config.force_include_usage and body.stream and not (body.stream_options and body.stream_options.include_usage):
        body.stream_options = StreamOptions(include_usage=True)


def running_usage(body: SamplingFields, prompt_tokens: int, tokens_sent: Iterable[int]) -> Usage | None:
    """stream_options.continuous_usage_stats (vLLM's, with include_usage): the usage so far, which
    every chunk carries; None when not asked for."""
    options = body.stream_options
    if not (options and options.include_usage and options.continuous_usage_stats):
        return None
    completion_tokens = sum(tokens_sent)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def refuse_unsupported(body: SamplingFields) -> None:
    """A 400 for the first field the body sets that this server cannot honour (empty or false asks nothing)."""
    for name, message in _UNSUPPORTED.items():
        if getattr(body, name, None):
            raise APIError(400, message, param=name)
    if set(getattr(body, "modalities", None) or ()) - {"text"}:
        raise APIError(400, "modalities other than text are not available here", param="modalities")
    if body.stream and body.prompt_logprobs:  # as vLLM: they would all come before the first token
        raise APIError(400, "prompt_logprobs is not available with stream", param="prompt_logprobs")


def requested_adapter(requested: str | None, config: ServerConfig) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model), once checked as served."""
    names = config.model_names + tuple(config.lora_modules)
    if requested is not None and requested not in names:
        raise APIError(404, f"model {requested!r} is not served here; this server serves "
                            f"{', '.join(repr(n) for n in names)}", param="model")
    return requested if requested in config.lora_modules else None


def truncate_prompt(prompt_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """engine.sampling_params.truncate_prompt, its refusal a 400."""
    try:
        return truncate_prompt_ids(prompt_ids, keep, max_model_len)
    except ValueError as exc:
        raise APIError(400, str(exc), param="truncate_prompt_tokens") from None


def check_prompt_ids(prompt_ids: list[int], *, vocab_size: int, max_model_len: int, max_tokens: int | None,
                     param: str = "prompt") -> int:
    """Validate one tokenized prompt (the request's field `param`); returns max_tokens, defaulting
    to the rest of the context."""
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", param=param)
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (size {vocab_size})", param=param)
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise ContextLengthError(f"this model's maximum context length is {max_model_len} tokens, "
                                 f"but the prompt has {len(prompt_ids)}", param=param)
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise ContextLengthError(f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                                 f"{len(prompt_ids)} and max_tokens asks for {max_tokens} more", param="max_tokens")
    return max_tokens


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _response_format(value: dict) -> dict | None:
    """OpenAI's response_format as a structured_outputs field (None for plain text)."""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if schema is None:
            raise ValueError("json_schema needs json_schema.schema")
        return {"json": schema}
    if kind == "structural_tag":  # vLLM's extension: the object itself is the tag
        return {"structural_tag": value}
    raise ValueError(f"type must be text, json_object, json_schema or structural_tag, got {kind!r}")


def structured_outputs(req: SamplingFields) -> StructuredOutputs | None:
    """The one output constraint the request asks for, from whichever field it used (400 if several)."""
    asked = {}
    if req.structured_outputs is not None:
        asked["structured_outputs"] = req.structured_outputs
    asked.update({name: {kind: getattr(req, name)} for name, kind in _GUIDED.items() if getattr(req, name) is not None})
    if req.response_format is not None:
        try:
            fields = _response_format(req.response_format)
        except ValueError as exc:
            raise APIError(400, f"response_format: {exc}", param="response_format") from None
        if fields is not None:
            asked["response_format"] = fields
    if len(asked) > 1:
        raise APIError(400, f"give one output constraint, not {' and '.join(asked)}", param=list(asked)[1])
    if not asked:
        return None
    (name, fields), = asked.items()
    unknown = sorted(set(fields) - set(StructuredOutputs.__dataclass_fields__))
    if unknown:
        raise APIError(400, f"{name}: unknown field {unknown[0]!r}; the fields are "
                            f"{', '.join(StructuredOutputs.__dataclass_fields__)}", param=name)
    try:
        return StructuredOutputs(**fields)
    except (TypeError, ValueError) as exc:  # TypeError: a value of the wrong type for xgrammar
        raise APIError(400, f"{name}: {exc}", param=name) from None


# What each field asks of beam search when left at this value: nothing. Set otherwise it is a 400,
# as beam search ranks whole continuations by their raw logprobs and honours none of them.
_NOT_WITH_BEAM_SEARCH = {
    "stop": None, "stop_token_ids": None, "min_tokens": 0, "presence_penalty": None, "frequency_penalty": None,
    "repetition_penalty": None, "logit_bias": None, "allowed_token_ids": None, "bad_words": None,
    "response_format": None, "structured_outputs": None, "guided_json": None, "guided_regex": None,
    "guided_choice": None, "guided_grammar": None, "prompt_logprobs": None,
}


def engine_params(req: SamplingFields, *, max_tokens: int, max_n: int, logprobs: int | None,
                  prompt_logprobs: int | None, vocab_size: int, max_logprobs: int,
                  defaults: dict[str, float] | None = None,
                  tool_constraint: StructuredOutputs | None = None) -> SamplingParams | BeamSearchParams:
    """What the engine runs for the request: beam search when it asks for it, else sampling.
    `defaults` are the generation config's; its max_tokens (max_new_tokens) caps `max_tokens`."""
    if defaults and "max_tokens" in defaults:
        max_tokens = min(max_tokens, int(defaults["max_tokens"]))
    if not req.use_beam_search:
        return build_sampling_params(req, max_tokens=max_tokens, max_n=max_n, logprobs=logprobs,
                                     prompt_logprobs=prompt_logprobs, vocab_size=vocab_size,
                                     max_logprobs=max_logprobs, defaults=defaults,
                                     tool_constraint=tool_constraint)
    _check_n(req, max_n)
    for name, neutral in _NOT_WITH_BEAM_SEARCH.items():
        if getattr(req, name, neutral) not in (neutral, [], {}, False):
            raise APIError(400, f"{name} cannot be combined with use_beam_search", param=name)
    if tool_constraint is not None:
        raise APIError(400, "tool_choice cannot be combined with use_beam_search", param="tool_choice")
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                length_penalty=req.length_penalty, cache_salt=req.cache_salt)
    except ValueError as exc:
        raise APIError(400, str(exc), param="n") from None


def _check_n(req: SamplingFields, max_n: int) -> None:
    if req.n > max_n:
        raise APIError(400, f"n must be at most {max_n}, got {req.n}", param="n")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of other than n is not supported", param="best_of")


def build_sampling_params(
    req: SamplingFields, *, max_tokens: int, max_n: int, logprobs: int | None, prompt_logprobs: int | None,
    vocab_size: int, max_logprobs: int, defaults: dict[str, float] | None = None,
    tool_constraint: StructuredOutputs | None = None,
) -> SamplingParams:
    """Map OpenAI/vLLM fields onto `SamplingParams`; its own validation errors become 400s.

    A sampling field the request leaves out takes `defaults` (the model's generation config), then
    SamplingParams' own default. `tool_constraint` is what a chat request's tool_choice asks of
    the output (server.tools), which excludes asking for structured outputs as well."""
    defaults = defaults or {}

    def given_or_default(name: str, fallback: float) -> float:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    _check_n(req, max_n)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        logit_bias = {int(token): bias for token, bias in req.logit_bias.items()} if req.logit_bias else None
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (integers)", param="logit_bias") from None
    constraint = structured_outputs(req)
    if tool_constraint is not None:
        if constraint is not None:
            raise APIError(400, "tool calls and a structured output format cannot be combined", param="tool_choice")
        constraint = tool_constraint
    try:
        params = SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            temperature=given_or_default("temperature", 1.0),
            top_p=given_or_default("top_p", 1.0),
            top_k=given_or_default("top_k", 0),
            min_p=given_or_default("min_p", 0.0),
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=given_or_default("repetition_penalty", 1.0),
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=logit_bias,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=list(req.bad_words or []),
            structured_outputs=constraint,
            cache_salt=req.cache_salt,
        )
        params.check_vocabulary(vocab_size)
        params.check_logprobs(max_logprobs, vocab_size)
        return params
    except ValueError as exc:
        message = str(exc)
        raise APIError(400, message, param=message.split(" ", 1)[0]) from None
