"""The HTTP layer's own settings (the engine's live in `EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.pooling import ClassifierConfig, PoolingConfig
from server.reasoning import REASONING_PARSERS
from server.tools import TOOL_CALL_PARSERS

# apply_chat_template's own arguments, which template variables (a request's or the server's) must not override
TEMPLATE_ARGUMENTS = frozenset({"conversation", "chat_template", "tokenize", "add_generation_prompt",
                                "continue_final_message", "tools", "documents", "return_dict"})


@dataclass(slots=True)
class ServerConfig:
    """What the app needs to know beyond the engine: names, auth, limits."""

    served_model_name: str  # what responses name the model
    model_root: str | None = None  # the served folder, reported as the model card's `root` (as vLLM does)
    api_key: str | None = None
    metrics_public: bool = False  # /health and /metrics open even when api_key is set
    max_queue: int = 1024  # requests not yet started before new ones get 429
    request_timeout_s: float | None = None  # 504 past this many seconds
    max_n: int = 16  # largest `n` one request may ask for
    log_requests: bool = False  # log each request's prompt and sampling fields (server.generation.log_received)
    max_log_len: int | None = None  # ... cut to this many characters and token ids
    retry_after_s: int = 1  # advertised in 429 responses
    access_log: bool = True  # one JSON line per HTTP request on driftgate.server.access
    log_stats_interval_s: float | None = None  # a throughput/load line this often (server.stats_log); None: off
    # vLLM's server-wide defaults for request fields: logprob tokens named "token_id:N", and a usage
    # chunk closing every stream whether or not stream_options asks for it
    return_tokens_as_token_ids: bool = False
    force_include_usage: bool = False
    # what a request that leaves a sampling field out gets (the model's generation_config.json)
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    chat_template: str | None = None  # a Jinja template replacing the tokenizer's (--chat-template)
    # template variables every chat gets unless its chat_template_kwargs sets them (e.g. enable_thinking)
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    allowed_origins: tuple[str, ...] = ()  # browser origins CORS lets call the API ("*": any); none by default
    aliases: tuple[str, ...] = ()  # more names requests may use (vLLM's extra --served-model-name values)
    tool_call_parser: str | None = None  # how tool_choice "auto" finds calls in the output (server.tools)
    reasoning_parser: str | None = None  # how a reasoning model's thinking is told from its answer (server.reasoning)
    responses_store_size: int = 256  # finished /v1/responses kept for previous_response_id (oldest dropped; 0: none)
    lora_modules: dict[str, str] = field(default_factory=dict)  # LoRA adapter name (a `model` to ask for) → folder
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; off unless asked for: they
    # read folders named over the network); adapters they load are added to lora_modules
    allow_runtime_lora_updating: bool = False
    runtime_loras: set[str] = field(default_factory=set)  # the names loaded that way (only they unload)
    pooling: PoolingConfig = field(default_factory=PoolingConfig)  # how /v1/embeddings pools (the model's own)
    classifier: ClassifierConfig | None = None  # a sequence classifier's classes (/classify, /score, /rerank)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.aliases)

    def __post_init__(self) -> None:
        if not self.served_model_name or not all(self.aliases):
            raise ValueError("served model names must be non-empty")
        if clash := sorted(set(self.lora_modules) & set(self.model_names)):
            raise ValueError(f"LoRA adapter name(s) {', '.join(clash)} are also the base model's served names")
        if clash := sorted(TEMPLATE_ARGUMENTS & self.default_chat_template_kwargs.keys()):
            raise ValueError(f"default chat template kwargs may not set {', '.join(clash)}")
        if self.api_key == "":
            raise ValueError("api_key must be non-empty when given")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size cannot be negative, got {self.responses_store_size}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {self.max_queue}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len cannot be negative, got {self.max_log_len}")
        if self.log_stats_interval_s is not None and self.log_stats_interval_s <= 0:
            raise ValueError(f"log_stats_interval_s must be positive, got {self.log_stats_interval_s}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be at least 1, got {self.max_n}")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be at least 1, got {self.retry_after_s}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; known: "
                             f"{', '.join(REASONING_PARSERS)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}; known: "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
