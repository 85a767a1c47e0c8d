"""`driftgate` console script: one entry point, each subcommand owned by its package.

Subcommand modules are imported only when chosen, so `driftgate import-model` does not pay for
FastAPI or lm-eval.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import KV_CACHE_DTYPES, KV_SCALES
from engine.spec_decode import SPECULATIVE_CONFIG_HELP, speculative_config_arg
from server.flags import human_int

if TYPE_CHECKING:
    from engine import LLM, LoRARequest

# `driftgate bench NAME` → (module, function adding its arguments, function running it, one-line help)
BENCHES = {
    "offline": ("bench.offline", "add_offline_args", "run_offline", "offline throughput and batch-1 decode vs HF"),
    "serve": ("bench.serve", "add_bench_serve_args", "run_bench_serve", "load-test an OpenAI-compatible server"),
    "ppl": ("bench.perplexity", "add_ppl_args", "run_ppl",
            "WikiText-2 perplexity of checkpoints on a fixed token budget"),
    "schemes": ("bench.schemes", "add_schemes_args", "run_schemes",
                "decode and concurrent throughput per quantization scheme, llama.cpp side by side"),
    "steps": ("bench.steps", "add_steps_args", "run_steps",
              "engine step time per prefill length and decode batch (cluster-sim --calibrate-from)"),
    "matmul": ("bench.matmul", "add_matmul_args", "run_matmul",
               "the CPU matmul kernel vs oneDNN and F.linear on the model's shapes"),
    "attention": ("bench.attention", "add_attention_args", "run_attention",
                  "the CPU prompt-attention kernel vs torch SDPA on the model's head shape"),
    "load": ("bench.load", "add_load_args", "run_load",
             "seconds and peak memory of loading checkpoints into an engine (a fresh process each)"),
    "spec": ("bench.spec_decode", "add_spec_args", "run_spec",
             "prompt-lookup speculative decoding vs plain decoding, per kind of text"),
    "router": ("bench.router", "add_router_args", "run_router",
               "routing decisions per second of the coordinated router (fabricated replica states)"),
    "vllm": ("bench.vllm_interop", "add_vllm_args", "run_vllm_bench",
             "our checkpoints in vLLM against driftgate: logprobs and greedy tokens on the same inputs"),
}

# commands whose arguments belong to another tool, passed on unparsed (help included)
PASSTHROUGH = {"lm-eval"}
# name → (module, function adding its arguments, function running it, one-line help)
COMMANDS = {
    "import-model": ("engine.cli", "add_import_args", "run_import", "import a GGUF (default: SmolLM2-135M) as an HF folder"),
    "generate": ("engine.cli", "add_generate_args", "run_generate", "offline generation for prompts or chats"),
    "chat": ("engine.chat_repl", "add_chat_args", "run_chat", "talk to a model in the terminal (streamed, multi-turn)"),
    "quantize": ("calibration.cli", "add_quantize_args", "run_quantize", "calibrate and quantize a model"),
    "gate": ("evals.cli", "add_gate_args", "run_gate", "gate a quantized checkpoint against its baseline"),
    "serve": ("server.cli", "add_serve_args", "run_serve", "OpenAI-compatible HTTP server"),
    "run-batch": ("server.batch", "add_batch_args", "run_batch", "answer an OpenAI batch file (JSONL) offline"),
    "lm-eval": ("evals.lm_eval_cli", "add_lm_eval_args", "run_lm_eval",
                "lm-evaluation-harness's command line, with --model driftgate (our engine)"),
    "bench": ("engine.cli", "add_bench_args", "run_bench", "benchmarks: " + ", ".join(BENCHES)),
    "cluster-sim": ("engine.cluster.sim", "add_sim_args", "run_sim", "simulate routing policies on N nodes"),
}


def add_import_args(parser: argparse.ArgumentParser) -> None:
    from engine.model_import import KNOWN_MODELS

    parser.add_argument("name", nargs="?", help=f"a known model: {', '.join(KNOWN_MODELS)}")
    parser.add_argument("--gguf", type=Path, help="import this Llama-family GGUF file instead")
    parser.add_argument("--dest", type=Path, help="output folder (default: $DRIFTGATE_HOME/models/NAME)")
    parser.add_argument("--force", action="store_true",
                        help="re-import even if the folder exists, replacing it whatever it holds")


def run_import(args: argparse.Namespace) -> int:
    """A bad GGUF, a --dest that must not be replaced or cannot be written, no network: one line, exit 2."""
    from engine.model_import import import_model

    try:
        path = import_model(args.name, gguf=args.gguf, dest=args.dest, force=args.force)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder")
    parser.add_argument("prompts", nargs="+", help="prompts (chat messages with --chat)")
    parser.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(parser)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """How `generate` and `chat` load the model."""
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (CUDA when there is a GPU)")
    parser.add_argument("--max-model-len", type=human_int, default=None,
                        help="the context in tokens, e.g. 4096 or 4K (default: the model's; llama-cli's -c)")
    parser.add_argument("--kv-cache-memory-bytes", type=human_int, default=None,
                        help="the KV cache's size, e.g. 4G (default: 1 GiB on a CPU; on CUDA what 90%% of the "
                             "device's memory leaves)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--kv-scales", choices=KV_SCALES, default="checkpoint",
                        help="fp8 KV scales: calibrated from the checkpoint, or dynamic (from the first batch)")
    parser.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                        help=SPECULATIVE_CONFIG_HELP)
    parser.add_argument("--lora", default=None, metavar="DIR", help="answer through this PEFT LoRA adapter")


def llm_from_args(args: argparse.Namespace) -> tuple[LLM, LoRARequest | None]:
    """The `LLM` and the LoRA request (or None) `add_engine_args`' flags ask for (ValueError if refused)."""
    from engine import LLM, LoRARequest

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_cache_dtype=args.kv_cache_dtype, kv_scales=args.kv_scales,
              speculative_config=args.speculative_config, enable_lora=args.lora is not None)
    if args.kv_scales == "dynamic":
        print("note: fp8 KV cache with dynamic scales (uncalibrated, from the first batch)", file=sys.stderr)
    return llm, None if args.lora is None else LoRARequest("lora", 1, args.lora)


def run_generate(args: argparse.Namespace) -> int:
    from engine import SamplingParams

    try:
        llm, lora = llm_from_args(args)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        if args.chat and not getattr(llm.tokenizer, "chat_template", None):
            raise ValueError(f"{args.model}'s tokenizer has no chat template; leave out --chat to generate from "
                             "the prompts as they are")
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, lora_request=lora)
        else:
            outs = llm.generate(args.prompts, params, lora_request=lora)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outs, strict=True):
        print(f"### {prompt}\n{out.outputs[0].text}\n")
    return 0




def add_bench_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True)
    for name, (module, add_fn, _, help_text) in BENCHES.items():
        getattr(importlib.import_module(module), add_fn)(sub.add_parser(name, help=help_text))


def run_bench(args: argparse.Namespace) -> int:
    """A missing or corrupt model, or missing data, is the user's to fix: one line, exit 2."""
    from bench.output import check_result_paths

    module, _, run_fn, _ = BENCHES[args.bench_command]
    try:
        check_result_paths(args)
        return getattr(importlib.import_module(module), run_fn)(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def build_parser(command: str | None, argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser with `command`'s arguments; for those taking serve's flags, argv's `--config FILE`
    sets their defaults."""
    parser = argparse.ArgumentParser(prog="driftgate", description="Serve quantized LLMs that provably did not drift.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, add_fn, _, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, add_help=name not in PASSTHROUGH)
        if name == command:
            getattr(importlib.import_module(module), add_fn)(sp)
            if name in ("serve", "run-batch") and argv:
                from server.flags import apply_config_file

                apply_config_file(sp, argv)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None, argv)
    if command in PASSTHROUGH:  # another tool's command line: everything after the command is its own
        args = parser.parse_args(argv[:argv.index(command) + 1])
        args.passthrough = argv[argv.index(command) + 1:]
    else:
        args = parser.parse_args(argv)
    module, _, run_fn, _ = COMMANDS[args.command]
    return getattr(importlib.import_module(module), run_fn)(args)


if __name__ == "__main__":
    sys.exit(main())
