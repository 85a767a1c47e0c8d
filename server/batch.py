"""`driftgate run-batch`: an OpenAI batch file answered offline by the server's own routes (vLLM's run-batch).

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with url one of `URLS`; each
output line, in the input's order, is `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`, as OpenAI's Batch API writes them. The lines run concurrently
through the FastAPI app in this process, so continuous batching packs them and every line gets
the validation and the answer `serve` would give it (a bad field is that line's 400). A line that
is no request at all (not JSON, an unknown url, `stream: true`) gets an `error` naming its line,
and the others still run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import uuid
from pathlib import Path

import httpx
from fastapi import FastAPI
from tqdm import tqdm

from engine.json_object import numbered_lines, parse_json_object
from engine.output_paths import check_output_path
from server.app import build_app
from server.cli import add_serve_args, build_engine, engine_config, is_cluster, server_config
from server.client import auth_headers

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/score", "/v1/rerank")


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", type=Path, required=True, help="OpenAI batch input, JSONL")
    parser.add_argument("-o", "--output-file", type=Path, required=True, help="where the answers go, JSONL")
    add_serve_args(parser)


class _LineError(ValueError):
    """A line that is not a request this batch can run (with its custom_id where it has one)."""

    def __init__(self, message: str, custom_id: object = None):
        super().__init__(message)
        self.custom_id = custom_id


def _request(number: int, text: str) -> tuple[object, str, dict]:
    """(custom_id, url, body) of input line `number`, or _LineError saying why it is not one."""
    try:
        line = parse_json_object(text)
    except ValueError as exc:
        raise _LineError(f"line {number}: {exc}") from None
    custom_id, body = line.get("custom_id"), line.get("body")
    if line.get("method", "POST") != "POST":
        raise _LineError(f"line {number}: method must be POST, got {line['method']!r}", custom_id)
    if line.get("url") not in URLS:
        raise _LineError(f"line {number}: url must be one of {', '.join(URLS)}, got {line.get('url')!r}", custom_id)
    if not isinstance(body, dict):
        raise _LineError(f"line {number}: body must be a JSON object", custom_id)
    if body.get("stream"):
        raise _LineError(f"line {number}: a batch answers whole; stream must be false", custom_id)
    return custom_id, line["url"], body


def _check_custom_ids(lines: list[tuple[int, str]]) -> None:
    """ValueError if two requests share a custom_id, by which answers are matched to requests (OpenAI's
    Batch API refuses such a file too). Lines that are no request are left to their own errors."""
    seen: dict[str, int] = {}
    for number, text in lines:
        try:
            custom_id = parse_json_object(text).get("custom_id")
        except ValueError:
            continue
        if custom_id is None:
            continue
        key = json.dumps(custom_id)
        if key in seen:
            raise ValueError(f"custom_id {key} is on lines {seen[key]} and {number}; each request needs its own")
        seen[key] = number


def _record(custom_id: object, response: dict | None = None, error: str | None = None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
            "error": None if error is None else {"code": "invalid_request", "message": error}}


async def answer_lines(app: FastAPI, lines: list[tuple[int, str]], concurrency: int,
                       headers: dict[str, str]) -> list[dict]:
    """One output record per (line number, text), in order; at most `concurrency` requests in flight."""
    gate = asyncio.Semaphore(concurrency)
    progress = tqdm(total=len(lines), desc="run-batch", unit="request", file=sys.stderr, disable=None)

    async def answer(client: httpx.AsyncClient, number: int, text: str) -> dict:
        try:
            custom_id, url, body = _request(number, text)
            async with gate:
                reply = await client.post(url, json=body, headers=headers)
            content = reply.json()
            return _record(custom_id, {"status_code": reply.status_code, "request_id": content.get("id", ""),
                                       "body": content})
        except _LineError as exc:
            return _record(exc.custom_id, error=str(exc))
        finally:
            progress.update()

    # an error the app did not foresee is that line's 500 (the server's error body), not the batch's end
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
        try:
            return await asyncio.gather(*(answer(client, number, text) for number, text in lines))
        finally:
            progress.close()


def run_batch(args: argparse.Namespace) -> int:
    """0 once every line has its answer written (a line's own error included); 2 on bad
    arguments or an unreadable input file, 1 if the model failed to load."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request says nothing the output does not
    try:
        config, settings = server_config(args), engine_config(args)
        lines = numbered_lines(args.input_file, "batch input file")
        if not lines:
            raise ValueError(f"{args.input_file}: no requests in the batch input file")
        _check_custom_ids(lines)
        check_output_path(args.output_file, folder=False)  # before the answers, not after
        if args.output_file.resolve() == args.input_file.resolve():
            raise ValueError(f"{args.output_file} is the batch input file; give the answers another file")
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if is_cluster(args):
        from engine.cluster.cluster_engine import init_ray

        init_ray(args.ray_address, args.replicas)
    try:
        engine = build_engine(args, settings)
        engine.start()
    except ValueError as exc:  # a setting or a checkpoint we refuse, with its reason
        print(f"error: could not load {args.model}: {exc}", file=sys.stderr)
        return 1
    try:
        records = asyncio.run(answer_lines(build_app(engine, config), lines, min(config.max_queue, 256),
                                           auth_headers(config.api_key)))
    finally:
        engine.shutdown()
        if is_cluster(args):
            import ray

            ray.shutdown()
    args.output_file.parent.mkdir(parents=True, exist_ok=True)
    args.output_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    failed = sum(1 for r in records if r["error"] or r["response"]["status_code"] != 200)
    print(f"wrote {args.output_file}: {len(records) - failed} answered, {failed} failed", file=sys.stderr)
    return 0
