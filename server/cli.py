"""`driftgate serve`: load the engine, serve it over HTTP, drain on SIGTERM.

With `--replicas N` (N > 1) or `--ray-address`, the engine is a `ClusterEngine`: N replicas on
Ray actors behind the router, which runs in this process; the routes are the same.

The port is bound before the model loads, so health checks see 503 ("loading") instead of a
refused connection. On SIGTERM (or Ctrl-C) the port closes to new connections and requests on
open ones get 503, while running ones finish; whatever still runs after `--drain-timeout` seconds
ends with a 503 (a stream: an error event, then [DONE]), then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import socket
import ssl
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import jinja2
import uvicorn

from engine.config import (
    KV_CACHE_DTYPES,
    KV_SCALES,
    EngineConfig,
    check_parallel_size,
    check_quantization,
    resolve_device,
    serving_setting,
)
from engine.generation_config import sampling_defaults
from engine.json_object import flag_json_object
from engine.loader import model_config, read_config
from engine.pooling import classifier_config, pooling_config
from engine.scheduler import SCHEDULING_POLICIES
from engine.spec_decode import SPECULATIVE_CONFIG_HELP, speculative_config_arg
from server.app import build_app
from server.config import ServerConfig
from server.flags import apply_config_file, human_int, positive_int, positive_seconds
from server.reasoning import REASONING_PARSERS
from server.state import ServerState
from server.tools import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from engine.serving import ServingEngine

logger = logging.getLogger("driftgate.server")


def _port(text: str) -> int:
    """argparse type: a TCP port number (a larger one would reach uvicorn and fail there with a traceback)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {port}")
    return port


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything loads: a taken port or an unknown host fails at once,
    not after the model (or a Ray cluster) came up."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _check_tls(args: argparse.Namespace) -> None:
    """--ssl-certfile and --ssl-keyfile load as a certificate and its key (ValueError saying why not),
    here rather than as uvicorn's traceback once the model has loaded."""
    if args.ssl_certfile is None and args.ssl_keyfile is None and args.ssl_ca_certs is None:
        return
    if args.ssl_certfile is None or args.ssl_keyfile is None:
        raise ValueError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs is not None:
            context.load_verify_locations(args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS certificate, key or CA certificates: {exc}") from None


def _json_object_arg(name: str) -> Callable[[str], dict]:
    """argparse's type for a flag that takes a JSON object (--hf-overrides and the like)."""
    def parse(value: str) -> dict:
        try:
            return flag_json_object(name, value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself; checked for Jinja syntax here, at startup."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        try:
            value = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {path}: {e}") from None
    elif "{" not in value:
        raise ValueError(f"--chat-template: no such file, and not a template: {value}")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: line {e.lineno}: {e.message}") from None
    return value


_ANSWER_S = 5.0  # after --drain-timeout ends the engine's requests, for their handlers to answer

# vLLM's switches that ask for what happens here anyway, accepted so a copied command line runs
_NO_EFFECT = {
    "--trust-remote-code": "every architecture is driftgate's own code; no checkpoint code runs",
    "--enable-chunked-prefill": "prompts are always prefilled in chunks of --max-num-batched-tokens",
    "--disable-log-requests": "prompts are logged only with --enable-log-requests",
    "--enable-prompt-tokens-details": "usage always carries prompt_tokens_details.cached_tokens",
    "--disable-fastapi-docs": "the OpenAPI docs pages are never served here",
}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` subcommand's flags (the console script in engine/cli.py dispatches here)."""
    parser.add_argument("model", nargs="?", default=None,
                        help="model folder (HF layout, bf16 or a driftgate/compressed-tensors checkpoint); may "
                             "come from --config instead")
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="read flags from a YAML file of long flag names (and `model`) to values, as vLLM's "
                             "serve does; flags on the command line win over the file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000, help="0: any free port (the log says which)")
    parser.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this PEM certificate (chain)")
    parser.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    parser.add_argument("--ssl-ca-certs", default=None,
                        help="mutual TLS: clients must present a certificate these CA certificates sign")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="names clients may use, the first in responses (default: the folder name)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one, instead of the tokenizer's")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="a tokenizer folder to use instead of the model's (its chat template with it), "
                             "for a checkpoint written without one")
    parser.add_argument("--default-chat-template-kwargs", type=_json_object_arg("default_chat_template_kwargs"),
                        default=None, metavar="JSON",
                        help='template variables every chat request gets unless its chat_template_kwargs sets '
                             'them, e.g. \'{"enable_thinking": false}\'')
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                        help="sampling defaults for fields a request leaves out: the model's generation_config.json "
                             "(auto), another folder's, or none (vllm, or none: temperature 1, no top-p/top-k); its "
                             "max_new_tokens caps every request's output")
    parser.add_argument("--override-generation-config", type=_json_object_arg("override_generation_config"),
                        default=None, metavar="JSON",
                        help='sampling defaults laid over --generation-config\'s, e.g. \'{"temperature": 0.6, '
                             '"max_new_tokens": 1024}\'')
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="return a reasoning model's <think> ... </think> as the chat message's "
                             "reasoning_content, apart from its content: deepseek_r1 (the template opens the "
                             "block; DeepSeek-R1 and its distills) or qwen3 (only an output that opens one)")
    parser.add_argument("--responses-store-size", type=int, default=256, metavar="N",
                        help="finished /v1/responses kept in memory for previous_response_id and GET (the "
                             "oldest dropped first; 0: none kept)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's flag, accepted: tool_choice \"auto\" is on whenever --tool-call-parser is set")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                        help='lets tool_choice "auto" (the default with tools) read calls from the model\'s own '
                             'output format: hermes = <tool_call>{...}</tool_call> (Hermes, Qwen2.5); llama3_json = '
                             'a reply of {"name": ..., "parameters": ...} objects (Llama 3.1/3.2); mistral = [TOOL_CALLS] '
                             'then the calls (Mistral); pythonic = a Python list of calls (Llama 3.2/4); granite = '
                             '<|tool_call|> and a JSON list (Granite); phi4_mini_json = functools[...] (Phi-4-mini); '
                             'qwen3_coder = <tool_call><function=...> XML (Qwen3-Coder). Without it only "required" '
                             'and named tool choices work')
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (or $DRIFTGATE_API_KEY)")
    parser.add_argument("--metrics-public", action="store_true", help="/health and /metrics need no key")
    parser.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                        help="let web pages from these origins call the API (CORS; '*' for any). vLLM and "
                             "llama.cpp allow any by default; here none do unless named")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (CUDA when there is a GPU)")
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="auto: the checkpoint's calibrated fp8 cache if it has one, else the model dtype; "
                             "float32 (with float32 activations) or bfloat16 keep a checkpoint's fp8 cache out, "
                             "bfloat16 at half an fp32 model's KV bytes; fp8 (e4m3) needs scales; fp8_e5m2 takes "
                             "none (less precise)")
    parser.add_argument("--kv-scales", choices=KV_SCALES, default="checkpoint",
                        help="fp8 KV scales: calibrated from the checkpoint, or dynamic (from the first batch)")
    parser.add_argument("--max-model-len", type=human_int, default=None, help="tokens, e.g. 8192 or 8K")
    parser.add_argument("--max-num-seqs", type=positive_int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=human_int, default=2048)
    parser.add_argument("--max-prefill-tokens-with-decodes", type=int, default=0,
                        help="while any stream decodes, prompt chunks take at most this many tokens per step, "
                             "bounding the stall a long prompt adds to every stream's next token (0: no cap)")
    parser.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                        help="fcfs: arrival order; priority: requests' `priority` field first (lower values "
                             "first, then arrival), and the least urgent running request is the one preempted")
    parser.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                        help=SPECULATIVE_CONFIG_HELP)
    parser.add_argument("--hf-overrides", type=_json_object_arg("hf_overrides"), default=None, metavar="JSON",
                        help="keys laid over the model's config.json, as vLLM's flag, e.g. a Qwen3-Reranker served "
                             'as a classifier: \'{"architectures": ["Qwen3ForSequenceClassification"], '
                             '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}\'')
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=human_int, default=None,
                        help="the KV cache's size, e.g. 4G (default: 1 GiB on a CPU; on CUDA what "
                             "--gpu-memory-utilization leaves)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                        help="on CUDA, the share of the device's memory this engine may hold: weights, working "
                             "memory and the KV cache (vLLM's; default 0.9)")
    parser.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", action="store_true",
                        help="recompute every prompt (vLLM's spelling accepted too)")
    parser.add_argument("--enable-prefix-caching", action="store_false", dest="no_prefix_caching",
                        help="vLLM's flag; prefix caching is on by default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-modules)")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="PEFT LoRA adapter folders, each served as model NAME over the base model")
    parser.add_argument("--max-lora-rank", type=int, default=64)
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="LoRA adapters kept in memory at once: past it the least recently used one no request "
                             "holds is dropped and read again from its folder when next asked for (default: all)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (reads folders named by clients)")
    parser.add_argument("--max-queue", type=int, default=1024, help="waiting requests before 429")
    parser.add_argument("--request-timeout", type=float, default=None, help="seconds before 504")
    parser.add_argument("--max-n", type=int, default=16, help="largest n per request")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="most logprobs / prompt_logprobs alternatives a request may ask for (-1: the vocabulary)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    parser.add_argument("--require-gate", action="store_true",
                        help="refuse to serve unless the checkpoint's verdict.json passes and matches its weights")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--uvicorn-log-level", default=None, choices=["trace", "debug", "info", "warning", "error",
                                                                      "critical"],
                        help="the HTTP server's (uvicorn's) own log level (default: --log-level)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no line every 10 s of throughput, queue and KV-cache use (logged only while busy)")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no line per HTTP request on driftgate.server.access (vLLM's name; /metrics still "
                             "counts them)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprob entries name tokens \"token_id:N\" for every request, as a request's own "
                             "return_tokens_as_token_ids does (exact where a token's text is not)")
    parser.add_argument("--enable-force-include-usage", action="store_true",
                        help="every stream ends with a usage chunk, as if stream_options.include_usage were set")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log each request's prompt, token ids and sampling fields (a JSON line on "
                             "driftgate.server.requests); prompts may be private, so off by default")
    parser.add_argument("--max-log-len", type=int, default=None, metavar="N",
                        help="with --enable-log-requests: the prompt cut to N characters and N token ids")
    cluster = parser.add_argument_group("cluster (needs `pip install driftgate[cluster]`)")
    cluster.add_argument("--replicas", "--data-parallel-size", "-dp", dest="replicas", type=int, default=1,
                         help="engine replicas, each a Ray actor; above 1 the router runs in this process "
                              "(vLLM's --data-parallel-size names the same: whole engines side by side)")
    cluster.add_argument("--ray-address", default=None,
                         help="join this Ray cluster (`auto`: the one on this machine); default: start a local one")
    cluster.add_argument("--router-policy", default="coordinated",
                         choices=["round-robin", "least-loaded", "coordinated"])
    cluster.add_argument("--replica-lost-after", type=positive_seconds, default=None, metavar="SECONDS",
                         help="a replica that answers no report for this long (a wedged process, a partitioned "
                              "node) is given up on: its streams restart elsewhere if nothing was sent yet, "
                              "else end with an error (default 30)")
    vllm = parser.add_argument_group("vLLM's flags that a copied command line carries")
    vllm.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                      help="1 only: a model runs on one device here (for more, --replicas)")
    vllm.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="1 only, as --tensor-parallel-size")
    vllm.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                      help="only the checkpoint's own (compressed-tensors): quantize with `driftgate quantize`, "
                           "gate, and serve its output")
    vllm.add_argument("--root-path", default="", metavar="PATH",
                      help="the prefix of a reverse proxy that strips it before passing requests on (e.g. /llm); "
                           "the routes, the key check and /metrics see the path without it")
    for flag, why in _NO_EFFECT.items():
        vllm.add_argument(flag, action="store_true", help=f"no effect: {why}")


def _check_gate(args: argparse.Namespace) -> str | None:
    """None when the checkpoint's verdict, and each --lora-modules adapter's, passes for these
    weights, activation dtype and KV cache; otherwise why the server must not start."""
    try:
        from evals.verdict import check_verdict
    except ImportError:
        return "--require-gate needs evals.verdict.check_verdict, which this install does not have"
    if args.allow_runtime_lora_updating:
        return ("--require-gate: adapters loaded at run time would bypass the gate; gate each adapter "
                "(driftgate gate --lora DIR) and serve it with --lora-modules")
    overrides = [flag for flag, value in (("--chat-template", args.chat_template), ("--hf-overrides", args.hf_overrides),
                                          ("--tokenizer", args.tokenizer)) if value is not None]
    if overrides:  # the verdict binds the folder's own config and template, which these replace
        return (f"--require-gate: {' and '.join(overrides)} would serve another model than the gate judged; "
                "make the change in the checkpoint's folder (tokenizer files, chat_template.jinja, config.json) "
                "and gate it there")
    try:  # any failure to prove a verdict is a refusal
        serving = serving_setting(args.model, args.dtype, args.device, args.kv_cache_dtype, args.kv_scales)
        base = check_verdict(args.model, serving)  # the checkpoint's hashes, read once for every adapter
    except Exception as exc:
        return f"--require-gate: {exc}"
    for name, folder in lora_modules(args.lora_modules).items():
        try:
            check_verdict(folder, serving, base_hashes=base)
        except Exception as exc:
            return f"--require-gate: adapter {name}: {exc}"
    return None


class _DrainingServer(uvicorn.Server):
    """uvicorn that flips the app to 503 on the first exit signal, then shuts down gracefully:
    at `drain_timeout` the engine ends what still runs, so every request answers (its handler
    sees the engine's error) before uvicorn, _ANSWER_S later, would cancel handlers mid-response."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        config.timeout_graceful_shutdown = drain_timeout + _ANSWER_S
        super().__init__(config)
        self.app_state = state
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self.drain_timeout, lambda: loop.run_in_executor(None, self._end_running))
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _end_running(self) -> None:
        if self.app_state.engine is not None:
            self.app_state.engine.shutdown()  # each request still running ends with an EngineError

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's own handler also records the signal and re-raises it after shutdown, which
        # would kill the process by SIGTERM after a clean drain; a drained server exits 0.
        self.app_state.begin_drain()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def is_cluster(args: argparse.Namespace) -> bool:
    return args.replicas > 1 or args.ray_address is not None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's settings from the flags; ValueError for one it refuses, found before the port is
    bound or the model loaded."""
    return EngineConfig(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        kv_scales=args.kv_scales,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes, block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, **_gpu_memory_utilization(args),
        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed, device=args.device,
        enforce_eager=args.enforce_eager, speculative_config=args.speculative_config,
        scheduling_policy=args.scheduling_policy, enable_lora=args.enable_lora,
        lora_modules=lora_modules(args.lora_modules), max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, hf_overrides=args.hf_overrides, max_logprobs=args.max_logprobs,
    )


def build_engine(args: argparse.Namespace, config: EngineConfig | None = None) -> ServingEngine:
    """One AsyncEngine in this process, or a ClusterEngine over `--replicas` Ray actors."""
    from engine import AsyncEngine

    config = config or engine_config(args)
    if not is_cluster(args):
        return AsyncEngine(config)
    from engine.cluster.cluster_engine import ClusterEngine

    lost_after = {} if args.replica_lost_after is None else {"lost_after_s": args.replica_lost_after}
    return ClusterEngine.launch(config, args.replicas, args.router_policy, args.ray_address, **lost_after)


def _gpu_memory_utilization(args: argparse.Namespace) -> dict[str, float]:
    """--gpu-memory-utilization for EngineConfig; on a CPU it has nothing to size (said, not ignored silently)."""
    if args.gpu_memory_utilization is None:
        return {}
    if not (device := resolve_device(args.device)).startswith("cuda"):
        logger.warning("--gpu-memory-utilization applies to CUDA devices; on %s the KV cache takes "
                       "--kv-cache-memory-bytes (1 GiB by default)", device)
    return {"gpu_memory_utilization": args.gpu_memory_utilization}


def _load_engine(args: argparse.Namespace, config: EngineConfig, state: ServerState, server: _DrainingServer,
                 failed: list[str]) -> None:
    """Runs in a thread while uvicorn already answers 503; attaches the engine when ready."""
    try:
        engine = build_engine(args, config)
        engine.start()
    except Exception as exc:
        if isinstance(exc, ValueError):  # a setting or a checkpoint we refuse, with its reason: no traceback
            logger.error("could not load %s: %s", args.model, exc)
        else:
            logger.exception("could not load %s", args.model)
        failed.append(str(exc))
        server.should_exit = True
        return
    state.attach(engine)
    where = (f" on {args.replicas} replicas ({args.router_policy} routing; a replica silent for "
             f"{engine.lost_after_s:g} s is given up on)" if is_cluster(args) else "")
    host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address, as a URL writes it
    logger.info("serving %s as %r%s on http://%s:%d", args.model, state.config.served_model_name, where, host, args.port)
    if args.kv_scales == "dynamic":
        logger.warning("fp8 KV cache with dynamic scales (uncalibrated, from the first batch)")
    if args.require_gate:
        _warn_of_what_the_gate_left_open(args.model, engine.max_model_len)


def _warn_of_what_the_gate_left_open(model: str, served_len: int) -> None:
    """A passing verdict still has edges: drift can grow with the context (an fp8 KV cache's does),
    so say when the server takes longer ones than the gate judged, and name checks passed by less
    than their sampling uncertainty."""
    from evals.verdict import judged_context_len, marginal_checks

    judged = judged_context_len(model)
    if judged is not None and served_len > judged:
        logger.warning("the gate judged contexts of up to %d tokens; this server takes up to %d (--max-model-len), "
                       "whose drift is not judged (gate with --policy long-context, or a policy whose [engine] "
                       "max_model_len covers them)", judged, served_len)
    if marginal := marginal_checks(model):
        logger.warning("the gate passed this checkpoint narrowly: %s; a gate scoring other or more text, or run on "
                       "another machine, could fail it (see its report)", "; ".join(marginal))


def lora_modules(specs: list[str]) -> dict[str, str]:
    """--lora-modules NAME=PATH ... as {name: folder} (vLLM's form); each folder must exist."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not (sep and name and path):
            raise ValueError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        if not Path(path).is_dir():
            raise ValueError(f"LoRA adapter folder not found: {path}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = str(Path(path).resolve())
    return modules


def _check_vllm_flags(args: argparse.Namespace) -> None:
    """vLLM's parallelism and on-the-fly quantization flags, refused with what to do here instead
    (a ValueError) unless they ask for what this server does anyway."""
    check_parallel_size("--tensor-parallel-size", args.tensor_parallel_size)
    check_parallel_size("--pipeline-parallel-size", args.pipeline_parallel_size)
    check_quantization("--quantization", args.quantization, args.model, args.hf_overrides)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The serve arguments checked and turned into the app's config; ValueError says what is wrong."""
    if args.model is None:
        raise ValueError("no model: name its folder first (driftgate serve MODEL_DIR), or as `model:` in --config")
    read_config(args.model)  # a missing folder, a file given, no or a broken config.json: said now
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        raise ValueError(f"tokenizer folder not found: {args.tokenizer}")
    if args.require_gate and (reason := _check_gate(args)) is not None:
        raise ValueError(reason)
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.replica_lost_after is not None and not is_cluster(args):
        raise ValueError("--replica-lost-after is for a cluster: give --replicas N (N > 1) or --ray-address")
    _check_vllm_flags(args)
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty (an unset shell variable?): give the key, or leave the flag out "
                         "to serve without one")
    if is_cluster(args) and importlib.util.find_spec("ray") is None:
        raise ValueError("--replicas above 1 and --ray-address need Ray, which is not installed; "
                         "install it with `pip install driftgate[cluster]`")
    config = ServerConfig(
        served_model_name=args.served_model_name[0] if args.served_model_name else Path(args.model).resolve().name,
        aliases=tuple(args.served_model_name[1:]) if args.served_model_name else (),
        model_root=str(Path(args.model).resolve()),
        api_key=args.api_key or os.environ.get("DRIFTGATE_API_KEY") or None,
        metrics_public=args.metrics_public, max_queue=args.max_queue,
        request_timeout_s=args.request_timeout, max_n=args.max_n,
        log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
        access_log=not args.disable_uvicorn_access_log, log_stats_interval_s=None if args.disable_log_stats else 10.0,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        force_include_usage=args.enable_force_include_usage,
        sampling_defaults=sampling_defaults(args.model, args.generation_config, args.override_generation_config),
        chat_template=_chat_template(args.chat_template), allowed_origins=tuple(args.allowed_origins),
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        responses_store_size=args.responses_store_size, lora_modules=lora_modules(args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating, pooling=pooling_config(args.model),
        classifier=classifier_config(model_config(args.model, args.hf_overrides)),
    )
    if args.allow_runtime_lora_updating and not (args.enable_lora or args.lora_modules):
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora (or --lora-modules)")
    if config.sampling_defaults:
        logger.info("requests that leave them out sample with the generation config's %s", config.sampling_defaults)
    return config


def run_serve(args: argparse.Namespace) -> int:
    """Serve until a signal; 0 after a clean drain, 1 if the model failed to load, 2 on bad input."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _check_tls(args)
        config = server_config(args)
        settings = engine_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        sock = _listen(args.host, args.port)
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    args.port = sock.getsockname()[1]  # the one the OS chose for --port 0
    if is_cluster(args):
        from engine.cluster.cluster_engine import init_ray

        try:
            init_ray(args.ray_address, args.replicas)  # here, on the main thread (see init_ray)
        except Exception as exc:  # Ray's own errors (address unreachable, version mismatch) vary
            sock.close()
            print(f"error: could not start or join Ray: {exc}", file=sys.stderr)
            return 1
    app = build_app(None, config)
    state: ServerState = app.state.driftgate
    server = _DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, root_path=args.root_path,
                                            log_level=args.uvicorn_log_level or args.log_level,
                                            access_log=False,
                                            ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                                            ssl_ca_certs=args.ssl_ca_certs,
                                            ssl_cert_reqs=ssl.CERT_REQUIRED if args.ssl_ca_certs else ssl.CERT_NONE),
                             state, args.drain_timeout)
    failed: list[str] = []
    loader = threading.Thread(target=_load_engine, args=(args, settings, state, server, failed), daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        loader.join()
        if state.engine is not None:
            state.engine.shutdown()
        if is_cluster(args):
            import ray

            ray.shutdown()
    if failed:
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m server.cli MODEL_DIR ...` (the same as `driftgate serve`)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="driftgate serve", description=__doc__.splitlines()[0])
    add_serve_args(parser)
    apply_config_file(parser, argv)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
