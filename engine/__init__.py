"""driftgate's inference engine: `from engine import LLM, SamplingParams, StructuredOutputs`."""

from engine.beam_search import BeamSearchParams
from engine.config import EngineConfig
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputs
from engine.thinking import ThinkingBudget


def __getattr__(name: str):
    # LLM, AsyncEngine and LoRA pull in torch and transformers; import them only when asked for.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine

        return AsyncEngine
    if name == "LoRARequest":
        from engine.lora import LoRARequest

        return LoRARequest
    raise AttributeError(name)


__all__ = ["LLM", "AsyncEngine", "EngineConfig", "SamplingParams", "BeamSearchParams", "StructuredOutputs",
           "ThinkingBudget", "RequestOutput", "CompletionOutput", "EngineStats", "LoRARequest"]
