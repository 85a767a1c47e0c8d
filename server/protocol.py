"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests accept the fields OpenAI clients send plus vLLM's sampling extensions (`top_k`,
`min_p`, `ignore_eos`, ...). Unknown fields are ignored, because real clients add fields
(`user`, `metadata`) that change nothing; fields that *would* change the output and that we
cannot honour (`suffix`, `functions`, beam search, ...) are
rejected by `params.refuse_unsupported` instead.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.errors import APIError

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string in a JSON value holding a lone UTF-16 surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        return next((hit for key, item in value.items() if (hit := _lone_surrogate(item, f"{path}.{key}"))), None)
    elif isinstance(value, list):
        return next((hit for i, item in enumerate(value) if (hit := _lone_surrogate(item, f"{path}[{i}]"))), None)
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        """JSON may escape half a surrogate pair ("\\ud800"), which is no character: the tokenizer
        (and a stop string, a bad word) would fail on it deep inside; a 400 naming the field instead."""
        if isinstance(data, dict) and (path := _lone_surrogate(data, "")):
            raise APIError(400, f"{path[1:]}: a lone UTF-16 surrogate is not text", param=path[1:])
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far on every chunk


class SamplingFields(_Request):
    """Fields shared by both generation routes; mapped onto `SamplingParams` by the handlers."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprob tokens as "token_id:N", exact ids
    # vLLM's: the prompt tokens' logprobs (each with this many alternatives; not with stream), and
    # the prompt's and output's token ids beside the text
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) → bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these
    bad_words: list[str] | None = None  # vLLM's: words the output must not contain
    # structured outputs: OpenAI's JSON mode and schemas, vLLM's structured_outputs and guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's beam search: n beams, the n best continuations returned (sampling fields do not apply)
    use_beam_search: bool = False
    length_penalty: float = 1.0  # hypotheses rank by summed logprob / generated length ** length_penalty
    # Accepted so we can refuse them with a clear message instead of silently ignoring them.
    best_of: int | None = None
    # vLLM's other output-shaping extensions this engine does not implement
    logits_processors: Any = None
    # vLLM's: keep only the prompt's last N tokens (-1: as many as the context holds)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    # vLLM's: lower is served first; other than 0 only under serve --scheduling-policy priority
    priority: int = 0
    # vLLM's: only requests with the same salt share cached prompt blocks (tenants cannot probe each other)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)
    ]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, for the chat template
    tool_call_id: str | None = None  # a tool turn's answer to one of them

    def text(self) -> str:
        """The message's content as one string (OpenAI allows a list of text parts)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # extend the last (assistant) message instead of opening a new one
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (e.g. enable_thinking)
    chat_template: Any = None  # a per-request template: refused (the server's is set with --chat-template)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | a named function
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None  # tools' predecessor: refused
    function_call: str | dict[str, Any] | None = None  # tool_choice's predecessor: refused
    audio: dict[str, Any] | None = None  # spoken output: refused, as is "audio" in modalities
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None  # refused: no search here
    # OpenAI's reasoning effort, as vLLM passes it: the chat template's `reasoning_effort` variable
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: at most this many tokens inside the thinking block, then its end is forced (needs --reasoning-parser)
    thinking_token_budget: Annotated[int, Field(ge=0)] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None  # shown to the chat template as a chat request's would be


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class LoadLoRAAdapterRequest(_Request):
    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoRAAdapterRequest(_Request):
    lora_name: Annotated[str, Field(min_length=1)]


# ---- responses --------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs shape, which lm-eval parses for log-likelihoods."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry for one token (rank 1 = the most probable)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # per prompt token; the first is None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop_token_id that ended it (not EOS)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: the whole prompt (a stream's first chunk)
    token_ids: list[int] | None = None  # return_token_ids: this choice's output ids (a stream's: this chunk's)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCall):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with serve --reasoning-parser: the thinking before the answer
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # as CompletionChoice's
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # as CompletionChoice's, on the choice's last chunk
    token_ids: list[int] | None = None  # return_token_ids: the ids this chunk adds


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "driftgate"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int


class PoolingFields(_Request):
    """What every pooling route (embeddings, classify, score, rerank) takes beside its inputs."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    priority: int = 0


class ClassificationRequest(PoolingFields):
    """vLLM's /classify request: one input or a list (text or token ids)."""

    input: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]


class EmbeddingRequest(ClassificationRequest):
    """OpenAI's embeddings request (and vLLM's truncate_prompt_tokens)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling request: the model's pooled output per input, as `task` asks ("embed": the
    embedding, "classify": a classifier's class probabilities; default: the served model's own)."""

    task: Literal["embed", "classify"] | None = None


class ScoreRequest(PoolingFields):
    """vLLM's /score request: text_1 against each of text_2 (or pairwise, lists of equal length)."""

    text_1: str | Annotated[list[str], Field(min_length=1)]
    text_2: str | Annotated[list[str], Field(min_length=1)]


class RerankRequest(PoolingFields):
    """The Jina / Cohere rerank request vLLM's /rerank takes; top_n 0 (or none) keeps every document."""

    query: str
    documents: Annotated[list[str], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=0)] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
