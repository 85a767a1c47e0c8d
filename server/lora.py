"""vLLM's runtime LoRA routes: load an adapter folder as a new model, or unload one loaded so."""

from __future__ import annotations

from pathlib import Path

from fastapi import Request
from fastapi.responses import PlainTextResponse

from engine.lora import LoRARequest
from server.errors import APIError
from server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from server.state import ServerState


def _config_allowing_updates(request: Request):
    state: ServerState = request.app.state.driftgate
    if not state.config.allow_runtime_lora_updating:
        raise APIError(400, "loading LoRA adapters at run time is off; serve with --enable-lora "
                            "--allow-runtime-lora-updating to allow it")
    return state, state.config


async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state, config = _config_allowing_updates(request)
    engine = state.ready_engine()
    name = body.lora_name
    if name in config.lora_modules:
        raise APIError(400, f"LoRA adapter {name!r} is already loaded", param="lora_name")
    if name in config.model_names:
        raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
    path = Path(body.lora_path).resolve()
    try:
        await engine.add_lora(LoRARequest(name, len(config.lora_modules) + 1, str(path)))
    except ValueError as exc:
        raise APIError(400, str(exc), param="lora_path") from None
    config.lora_modules[name] = str(path)
    config.runtime_loras.add(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state, config = _config_allowing_updates(request)
    engine = state.ready_engine()
    name = body.lora_name
    if name not in config.lora_modules:
        raise APIError(404, f"LoRA adapter {name!r} is not loaded", param="lora_name")
    if name not in config.runtime_loras:
        raise APIError(400, f"LoRA adapter {name!r} was loaded at start (--lora-modules) and stays",
                       param="lora_name")
    try:
        await engine.remove_lora(name)
    except ValueError as exc:  # requests in flight use it
        raise APIError(409, str(exc), param="lora_name") from None
    del config.lora_modules[name]
    config.runtime_loras.discard(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
