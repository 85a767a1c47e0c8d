"""`driftgate bench serve`: load-test any OpenAI-compatible server the way `vllm bench serve` does.

Metrics are measured at the client from streamed responses, with vLLM's definitions:
TTFT (send → first streamed text), ITL (gaps between consecutive text chunks, pooled over
requests), TPOT ((E2E − TTFT) / (output tokens − 1), per request), E2E latency (send → last
text chunk); request and token throughput; goodput = requests per second meeting *every*
`--slo`. Output tokens are the server's own count (`usage.completion_tokens`, as vLLM's bench
reads it), counted with the model's tokenizer only where a server sends none. What only
the server knows (prefix-cache hit rate; requests per replica on a cluster) comes from its
/metrics counters before and after each run.
Requests go only to `--base-url`; every loop is bounded by count and by `--max-duration`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench import datasets
from bench.datasets import Sample
from engine.slo import meets_slo, parse_slo, time_per_output_token
from server.client import api_base, auth_headers, model_cards

PERCENTILES = (50, 90, 99)
_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class RequestResult:
    """What one request measured (seconds); `error` is set when it failed."""

    prompt_len: int
    output_len: int = 0  # the server's usage.completion_tokens, else its text re-tokenized
    server_output_len: int | None = None  # usage.completion_tokens when the server reports it
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float:
        return time_per_output_token(self.ttft, self.latency, self.output_len)


def _summary(values: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std and each percentile (`p90`, `p99.9`) in milliseconds (zeros when there is
    nothing to summarize)."""
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    if arr.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p:g}": 0.0 for p in percentiles}}
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std()),
            **{f"p{p:g}": float(np.percentile(arr, p)) for p in percentiles}}


def metric_percentiles(text: str) -> tuple[float, ...]:
    """argparse type for --metric-percentiles: comma-separated percentiles in (0, 100], e.g. 50,90,99.9."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated numbers, e.g. 50,90,99; got {text!r}") from None
    if not all(0 < p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles lie in (0, 100]; got {text!r}")
    return values


def percentile_metrics(text: str) -> tuple[str, ...]:
    """argparse type for --percentile-metrics: a comma-separated subset of ttft,tpot,itl,e2el."""
    names = tuple(part.strip() for part in text.split(","))
    if unknown := [n for n in names if n not in _METRICS]:
        raise argparse.ArgumentTypeError(f"unknown metric(s) {', '.join(unknown)}; choose from {','.join(_METRICS)}")
    return names


def compute_metrics(results: list[RequestResult], duration_s: float, slo: dict[str, float],
                    percentiles: Sequence[float] = PERCENTILES) -> dict:
    """The `vllm bench serve` summary for one run (50, 90 and 99 always among the percentiles: the
    plots read them)."""
    percentiles = sorted(set(PERCENTILES) | set(percentiles))
    done = [r for r in results if r.error is None]
    total_out = sum(r.output_len for r in done)
    total_in = sum(r.prompt_len for r in done)
    good = sum(meets_slo(slo, ttft=r.ttft, e2el=r.latency, output_len=r.output_len) for r in done)
    return {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": total_out / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration_s if duration_s > 0 else 0.0,
        "goodput": (good / duration_s if duration_s > 0 else 0.0) if slo else None,
        "ttft_ms": _summary([r.ttft for r in done], percentiles),
        # TPOT is defined only where there is a second token
        "tpot_ms": _summary([r.tpot for r in done if r.output_len > 1], percentiles),
        "itl_ms": _summary([gap for r in done for gap in r.itl], percentiles),
        "e2el_ms": _summary([r.latency for r in done], percentiles),
        "errors": sorted({r.error for r in results if r.error})[:10],
    }


def arrival_gaps(num: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Gaps before each request: Gamma(shape=burstiness, scale=1/(rate·burstiness)); rate inf → 0.

    burstiness 1 is a Poisson process; below 1 burstier, above 1 more regular.
    """
    if math.isinf(rate):
        return np.zeros(num)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)


def _text_of(choice: dict, chat: bool) -> str:
    """A chunk's text: a completion's `text`, a chat delta's reasoning (`reasoning_content`, or newer
    vLLM's `reasoning`) and answer."""
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("reasoning_content") or delta.get("reasoning") or "") + (delta.get("content") or "")


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, chat: bool, tokenizer,
                       result: RequestResult) -> None:
    """Stream one request and fill `result`; any failure lands in `result.error`."""
    start = time.perf_counter()
    pieces: list[str] = []
    try:
        chunks = await _stream(client, url, payload, chat, result, start, pieces)
    except Exception as exc:  # noqa: BLE001 — whatever ends one request is that request's failure, not the run's
        result.error = f"{type(exc).__name__}: {exc}"
        return
    if result.error is not None:
        return
    if not chunks:  # as vLLM's bench: without a first chunk there is no TTFT to report
        result.error = "no chunk with choices before the stream ended"
        return
    result.output_len = (result.server_output_len if result.server_output_len is not None
                         else len(tokenizer.encode("".join(pieces), add_special_tokens=False)))


async def _stream(client: httpx.AsyncClient, url: str, payload: dict, chat: bool, result: RequestResult,
                  start: float, pieces: list[str]) -> int:
    """Read one streamed response into `result` (timings, the server's token count) and `pieces` (its
    text); returns how many chunks carried choices. As in vLLM's bench, every such chunk is a timing
    event (TTFT at the first, an ITL gap per later one, E2E at the last), its text empty or not (a chat
    stream's first chunk holds the role alone); `result.latency` is set once the stream has ended."""
    last, chunks = start, 0
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")[:200]
            result.error = f"HTTP {response.status_code}: {body}"
            return chunks
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                result.error = str(error.get("message", error) if isinstance(error, dict) else error)
                return chunks
            if event.get("usage"):
                result.server_output_len = event["usage"].get("completion_tokens")
            choices = event.get("choices")
            if not choices:
                continue
            now = time.perf_counter()
            if chunks:
                result.itl.append(now - last)
            else:
                result.ttft = now - start
            last, chunks = now, chunks + 1
            pieces.append(_text_of(choices[0], chat))
    result.latency = last - start  # to the last chunk with choices, not to a trailing usage chunk or [DONE]
    return chunks


def build_payload(sample: Sample, args: argparse.Namespace, chat: bool) -> dict:
    payload = {"model": args.model, "max_tokens": sample.output_len, "temperature": args.temperature,
               "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        payload["ignore_eos"] = True
    if chat:
        payload["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        payload["prompt"] = sample.prompt
    return payload


async def run_load(samples: list[Sample], args: argparse.Namespace, rate: float, tokenizer) -> dict:
    """Send every sample on the arrival schedule; returns the metrics dict plus raw per-request data."""
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    url = args.base_url.rstrip("/") + args.endpoint
    rng = np.random.default_rng(args.seed)
    gaps = arrival_gaps(len(samples), rate, args.burstiness, rng)
    limit = asyncio.Semaphore(args.max_concurrency or len(samples))  # None: no limit
    headers = auth_headers(args.api_key)
    results = [RequestResult(prompt_len=s.prompt_len) for s in samples]
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(samples), desc=f"rate {rate:g}", file=sys.stderr)

    async def one(sample: Sample, result: RequestResult) -> None:
        async with limit:
            await send_request(client, url, build_payload(sample, args, chat), chat, tokenizer, result)
        if progress is not None:
            progress.update(1)

    timeout = httpx.Timeout(args.timeout, connect=10.0)
    # each request's send time from the run's start: the first at once (as vLLM's bench), and sleeps
    # to absolute times, so the loop's own overhead does not slow the offered rate
    offsets = np.cumsum(gaps) - gaps[0] if len(gaps) else gaps
    async with httpx.AsyncClient(timeout=timeout, headers=headers,
                                 limits=httpx.Limits(max_connections=None)) as client:
        counters_before = await scrape_counters(client, args.base_url)
        start = time.perf_counter()
        deadline = start + args.max_duration
        tasks = []
        for sample, result, offset in zip(samples, results, offsets, strict=True):
            if start + offset > deadline:
                result.error = "not sent: --max-duration reached"
                continue
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(one(sample, result)))
        pending: set[asyncio.Task] = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
        counters_after = await scrape_counters(client, args.base_url)
    if progress is not None:
        progress.close()
    for result in results:
        if result.latency == 0.0 and result.error is None:
            result.error = "cancelled: --max-duration reached"
    metrics = compute_metrics(results, duration, parse_slo(args.slo), args.metric_percentiles)
    metrics["request_rate"] = rate
    metrics["server"] = server_side(counters_before, counters_after)
    metrics["requests"] = [asdict(r) for r in results]
    return metrics


# `vendor:name_total{labels} value`: driftgate's and vLLM's counters share names after the prefix
_COUNTER = re.compile(r"^[A-Za-z_]\w*:(\w+_total)(\{[^}]*\})? (\S+)$", re.MULTILINE)
_REPLICA_DISPATCHED = re.compile(r'replica_requests_dispatched_total\{replica="(\d+)"\}')


def parse_counters(text: str) -> dict[str, float]:
    """The counters of a Prometheus exposition, keyed `name_total{labels}` without the vendor prefix."""
    return {name + (labels or ""): float(value) for name, labels, value in _COUNTER.findall(text)}


async def scrape_counters(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """The server's /metrics counters, or {} when it has none (or none we may read)."""
    try:
        response = await client.get(base_url.rstrip("/") + "/metrics")
    except httpx.HTTPError:
        return {}
    return parse_counters(response.text) if response.status_code == 200 else {}


def server_side(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the server counted during one run: prefix-cache hit rate, and requests per replica.

    Measured as the change in its counters, so earlier traffic does not count; the hit rate is
    None when the server exports no prefix-cache counters.
    """
    delta = {key: value - before.get(key, 0.0) for key, value in after.items()}

    def total(name: str) -> float | None:
        """A counter summed over its label sets (vLLM labels each engine and model), None if absent."""
        values = [v for key, v in delta.items() if key == name or key.startswith(name + "{")]
        return sum(values) if values else None

    hits, queries = total("prefix_cache_hits_total"), total("prefix_cache_queries_total")
    result: dict = {"prefix_cache_hit_rate": hits / queries if hits is not None and queries else None}
    dispatched = {int(m.group(1)): int(v) for key, v in delta.items() if (m := _REPLICA_DISPATCHED.fullmatch(key))}
    if dispatched:
        result["replica_requests_dispatched"] = [dispatched[i] for i in sorted(dispatched)]
    return result


def load_samples(args: argparse.Namespace, tokenizer) -> list[Sample]:
    rng = np.random.default_rng(args.seed)
    if args.dataset == "sharegpt":
        return datasets.sharegpt(tokenizer, datasets.find_data_dir(args.data_dir), args.num_prompts,
                                 args.output_len, args.fixed_output_len, rng)
    if args.dataset == "random":
        return datasets.random_prompts(tokenizer, args.num_prompts, args.input_len, args.output_len, rng)
    return datasets.prefix_shared(tokenizer, args.num_prompts, args.prefix_len, args.input_len,
                                  args.output_len, rng, args.num_prefixes)


def plot(runs: list[dict], path: Path) -> list[Path]:
    """Latency CDFs of the last run; with several rates, also throughput/TTFT vs request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    last = runs[-1]
    done = [r for r in last["requests"] if r["error"] is None]
    series = {
        "TTFT": [r["ttft"] for r in done],
        "TPOT": [(r["latency"] - r["ttft"]) / (r["output_len"] - 1) for r in done if r["output_len"] > 1],
        "ITL": [g for r in done for g in r["itl"]],
        "E2E latency": [r["latency"] for r in done],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series.items(), strict=True):
        values = np.sort(np.asarray(values) * 1000.0)
        if values.size:
            ax.plot(values, np.arange(1, values.size + 1) / values.size)
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle(f"request rate {last['request_rate']:g}, {last['completed']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    if len(runs) > 1:
        # one position per rate, labelled, so an unlimited rate (inf) is plotted too
        positions, labels = range(len(runs)), [f"{r['request_rate']:g}" for r in runs]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        left.plot(positions, [r["output_throughput"] for r in runs], marker="o")
        left.set(xlabel="request rate (req/s)", ylabel="output tokens/s", title="throughput")
        right.plot(positions, [r["ttft_ms"]["median"] for r in runs], marker="o", label="TTFT p50")
        right.plot(positions, [r["ttft_ms"]["p99"] for r in runs], marker="o", label="TTFT p99")
        right.set(xlabel="request rate (req/s)", ylabel="ms", title="time to first token")
        right.legend()
        for ax in (left, right):
            ax.set_xticks(positions, labels)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        sweep_path = path.with_name(path.stem + "_sweep" + path.suffix)
        fig.savefig(sweep_path, dpi=110)
        plt.close(fig)
        written.append(sweep_path)
    return written


def print_summary(metrics: dict, names: Sequence[str] = _METRICS, percentiles: Sequence[float] = PERCENTILES) -> None:
    print(f"{'=' * 16} rate {metrics['request_rate']:g} {'=' * 16}")
    for key in ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "goodput"):
        value = metrics[key]
        if value is not None:
            print(f"{key:<26}{value:>12.2f}" if isinstance(value, float) else f"{key:<26}{value:>12}")
    for name in names:
        stats = metrics[f"{name}_ms"]
        print(f"{name.upper() + ' ms':<10} mean {stats['mean']:9.1f}"
              + "".join(f"  p{p:g} {stats[f'p{p:g}']:9.1f}" for p in percentiles))
    for error in metrics["errors"]:  # why requests failed (an unreachable server fails them all alike)
        print(f"{'failed with':<26}{error}")
    server = metrics.get("server", {})
    if server.get("prefix_cache_hit_rate") is not None:
        print(f"{'server prefix hit rate':<26}{server['prefix_cache_hit_rate']:>12.3f}")
    if "replica_requests_dispatched" in server:
        print(f"{'requests per replica':<26}{str(server['replica_requests_dispatched']):>12}")


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `driftgate bench serve` (dispatched from the `driftgate` console script)."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    parser.add_argument("--model", required=True, help="the served model name sent in each request")
    parser.add_argument("--tokenizer", default=None,
                        help="HF tokenizer folder (default: --model if a folder, else the folder the server serves it from)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset", "--dataset-name", default="sharegpt", choices=["sharegpt", "random", "prefix-shared"])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    parser.add_argument("--sweep", default=None, help="comma-separated request rates, run one after another")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--input-len", "--random-input-len", type=int, default=256,
                        help="random / prefix-shared question tokens")
    parser.add_argument("--output-len", "--random-output-len", type=int, default=128,
                        help="tokens asked per request (ShareGPT: median)")
    parser.add_argument("--fixed-output-len", action="store_true", help="ShareGPT: every request asks --output-len")
    parser.add_argument("--prefix-len", type=int, default=1024, help="prefix-shared: common prefix tokens")
    parser.add_argument("--num-prefixes", type=int, default=1,
                        help="prefix-shared: distinct common prefixes, one drawn at random per request")
    parser.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly max_tokens")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft:2000,tpot:100")
    parser.add_argument("--metric-percentiles", type=metric_percentiles, default=PERCENTILES, metavar="P,P,...",
                        help="percentiles printed (and kept in the JSON beside 50, 90, 99), as vLLM's, e.g. 50,99.9")
    parser.add_argument("--percentile-metrics", type=percentile_metrics, default=_METRICS, metavar="NAME,...",
                        help="which of ttft,tpot,itl,e2el are printed (the JSON holds all)")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="--slo as vLLM's bench spells it: ttft:2000 tpot:100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a response may go silent before it fails (httpx's read timeout)")
    parser.add_argument("--max-duration", type=float, default=3600.0, help="seconds per run before giving up")
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--plot", default=None, help="PNG path for latency CDFs (and _sweep.png)")
    parser.add_argument("--no-progress", action="store_true")


def check_server(args: argparse.Namespace) -> list[dict]:
    """Before any load: the server's model cards (ValueError saying why it does not answer with
    them, as vLLM's bench stops when its first test request fails), and a warning when they do not
    list `--model`."""
    cards = model_cards(api_base(args.base_url), args.api_key)
    served = [card["id"] for card in cards]
    if args.model not in served:
        print(f"warning: {api_base(args.base_url)}/models lists {served}, not --model {args.model!r}",
              file=sys.stderr)
    return cards


def tokenizer_folder(args: argparse.Namespace, cards: list[dict]) -> str:
    """--tokenizer; else --model if it is a folder; else the folder the server names for --model
    (a driftgate or vLLM model card's `root`), when this machine has it."""
    if args.tokenizer:
        candidates = [args.tokenizer]
    else:
        roots = [card.get("root") for card in cards if card.get("id") == args.model]
        candidates = [args.model] + [root for root in roots if isinstance(root, str)]
    folder = next((c for c in candidates if Path(c).is_dir()), None)
    if folder is None:
        raise ValueError(f"tokenizer folder not found: {' or '.join(candidates)} (pass --tokenizer)")
    return folder


def run_bench_serve(args: argparse.Namespace) -> int:
    """0 when every request succeeded, 1 when some failed, 2 on bad arguments or a server that does not answer."""
    from transformers import AutoTokenizer

    try:
        if args.goodput:
            if args.slo:
                raise ValueError("give the SLOs once: --slo or --goodput")
            args.slo = ",".join(args.goodput)
        parse_slo(args.slo)
        rates = [float(r) for r in args.sweep.split(",")] if args.sweep else [args.request_rate]
        if args.num_prompts < 1 or not all(r > 0 for r in rates) or not args.burstiness > 0:
            raise ValueError("--num-prompts, request rates (a number, or inf) and --burstiness must be positive")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1 (leave it out for no limit), got {args.max_concurrency}")
        if not (args.timeout > 0 and args.max_duration > 0):
            raise ValueError("--timeout and --max-duration must be positive seconds")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(args, check_server(args)))
        samples = load_samples(args, tokenizer)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runs = []
    for rate in rates:
        metrics = asyncio.run(run_load(samples, args, rate, tokenizer))
        print_summary(metrics, args.percentile_metrics, args.metric_percentiles)
        runs.append(metrics)
    result = {
        "base_url": args.base_url, "endpoint": args.endpoint, "model": args.model, "dataset": args.dataset,
        "num_prompts": args.num_prompts, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "output_len": args.output_len,
        **({"input_len": args.input_len} if args.dataset != "sharegpt" else {}),
        **({"prefix_len": args.prefix_len, "num_prefixes": args.num_prefixes} if args.dataset == "prefix-shared" else {}),
        "output_len_distribution": "fixed" if args.dataset != "sharegpt" or args.fixed_output_len
        else f"lognormal(median={args.output_len}, sigma={datasets.OUTPUT_LEN_SIGMA}), clipped to [4, 1024]",
        "ignore_eos": args.ignore_eos, "slo": args.slo, "seed": args.seed, "runs": runs,
    }
    if args.result_json:  # an unlimited rate as the string "inf", as vLLM's bench writes it (JSON has no Infinity)
        runs_json = [{**run, "request_rate": "inf" if math.isinf(run["request_rate"]) else run["request_rate"]}
                     for run in runs]
        Path(args.result_json).write_text(json.dumps({**result, "runs": runs_json}, indent=2))
    if args.plot:
        for path in plot(runs, Path(args.plot)):
            print(f"wrote {path}")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.serve ...` (the same as `driftgate bench serve`)."""
    parser = argparse.ArgumentParser(prog="driftgate bench serve", description=__doc__.splitlines()[0])
    add_bench_serve_args(parser)
    return run_bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
