"""Pure tensor code for quantized checkpoints: no JSONL, no model runs.

Modules, primitives first:
- ``int_quant``, ``fp8``: quantize / dequantize / pack with compressed-tensors conventions.
- ``schemes``, ``config``: what a checkpoint's ``quantization_config`` says, per Linear.
- ``gptq``, ``awq``, ``smoothquant``, ``smoothing``: algorithms the calibrator drives.
- ``linear``: the quantized Linear modules the engine serves with, one per scheme family.
- ``kv_cache``: FP8 KV-cache quantization and scale validation.
- ``checkpoint``: weights → checkpoint tensors, the folder writer, and the reader helpers.
"""
