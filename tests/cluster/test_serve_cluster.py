"""The OpenAI-compatible server in front of a 2-replica cluster on a local Ray instance (CPU, tiny model).

One test runs `driftgate serve --replicas 2` as a real process (flags, Ray started and stopped by
the server, SIGTERM); the others serve the same routes in-process over one shared pair of
replica actors, one router per policy, so each policy costs no extra Ray start-up.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

ray = pytest.importorskip("ray")

from engine.cluster.cluster_engine import ClusterEngine  # noqa: E402
from engine.cluster.replica import launch_replicas  # noqa: E402
from engine.cluster.router import RouterConfig  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402
from server.app import build_app  # noqa: E402
from server.config import ServerConfig  # noqa: E402
from tests.server.live import serve_in_thread  # noqa: E402
from tests.server.test_serve_cli import _free_port  # noqa: E402

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def metric(text: str, name: str, replica: int | None = None) -> float:
    """One sample from a Prometheus exposition (`driftgate:NAME`, optionally {replica="N"})."""
    labels = "" if replica is None else re.escape(f'{{replica="{replica}"}}')
    match = re.search(rf"^driftgate:{name}{labels} (\S+)$", text, re.MULTILINE)
    assert match, f"no driftgate:{name} {labels} in /metrics"
    return float(match.group(1))


def test_driftgate_serve_replicas_2_routes_a_shared_prefix_to_one_replica(tiny_model_dir):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", str(tiny_model_dir), "--port", str(port), "--served-model-name", MODEL,
         "--replicas", "2", "--router-policy", "coordinated", "--kv-cache-memory-bytes", "4000000",
         "--replica-lost-after", "45"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "cluster server did not become healthy"
            try:
                health = httpx.get(url + "/health", timeout=2)
                if health.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        assert [r["alive"] for r in health.json()["replicas"]] == [True, True]
        system = [(7 * j) % 300 + 3 for j in range(40)]  # two full 16-token blocks shared
        for i in range(6):
            body = {"model": MODEL, "prompt": system + [100 + i, 200 + i], "max_tokens": 2, "ignore_eos": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            time.sleep(0.2)  # the replica's KV events reach the router between requests
        text = httpx.get(url + "/metrics", timeout=5).text
        dispatched = [metric(text, "replica_requests_dispatched_total", i) for i in (0, 1)]
        assert sorted(dispatched) == [0, 6]
        served = dispatched.index(6)
        assert metric(text, "replica_prefix_cache_hits_total", served) >= 5 * 32  # every later prompt hit
        assert metric(text, "prefix_cache_hits_total") == metric(text, "replica_prefix_cache_hits_total", served)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        stderr = proc.communicate()[1]
    assert "a replica silent for 45 s is given up on" in stderr  # --replica-lost-after reached the router


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    config = EngineConfig(str(tiny_model_dir), block_size=8, num_kv_blocks=128, max_num_seqs=4)
    yield launch_replicas(config, 2, num_cpus=0.5), load_tokenizer(tiny_model_dir)
    ray.shutdown()


@contextmanager
def cluster_server(replicas, policy: str, **engine_kwargs) -> Iterator[tuple[str, ClusterEngine]]:
    actors, tokenizer = replicas
    engine = ClusterEngine(actors, RouterConfig(policy=policy, block_size=8), tokenizer, 0.01, **engine_kwargs)
    engine.start()
    try:
        with serve_in_thread(build_app(engine, ServerConfig(served_model_name=MODEL, request_timeout_s=60))) as url:
            yield url, engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "coordinated"])
def test_completions_and_chat_stream_or_not_under_every_policy(replicas, policy):
    import openai

    with cluster_server(replicas, policy) as (url, engine), \
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        full = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
        chunks = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text

        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens > 0
        chat_chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                                          temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices) \
            == chat.choices[0].message.content

        several = client.completions.create(model=MODEL, prompt=["one", "two", "three", "four"], max_tokens=3,
                                            temperature=0)  # four engine requests at once
        assert len(several.choices) == 4 and all(c.finish_reason for c in several.choices)

        assert sum(engine.num_dispatched) == 8
        if policy == "round-robin":
            assert engine.num_dispatched == [4, 4]
        engine.refresh()  # /metrics shows stats as of the router's last poll
        health = httpx.get(url + "/health", timeout=5).json()
        assert health["status"] == "ok" and [r["alive"] for r in health["replicas"]] == [True, True]
        text = httpx.get(url + "/metrics", timeout=5).text
        assert metric(text, "router_num_requests_queued") == 0
        assert [metric(text, "replica_requests_dispatched_total", i) for i in (0, 1)] == engine.num_dispatched


def test_bad_requests_and_disconnects_through_the_cluster(replicas):
    """The single-node contract holds behind the router: a bad field or an over-long prompt is an
    OpenAI-style 400 (nothing dispatched), and a client that leaves mid-stream frees its replica's
    KV blocks and its place in the router."""
    with cluster_server(replicas, "coordinated") as (url, engine):
        bad = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "temperature": -1}, timeout=30)
        long = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5] * 5000, "max_tokens": 4},
                          timeout=30)
        for response in (bad, long):
            assert response.status_code == 400
            assert response.json()["error"]["type"] == "invalid_request_error"
        assert sum(engine.num_dispatched) == 0

        engine.refresh()
        generated_before = engine.stats().num_generation_tokens
        body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 500, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # streaming has begun
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            engine.refresh()
            stats = engine.stats()
            if stats.num_running == 0 and stats.num_blocks_free == stats.num_blocks_total:
                break
            time.sleep(0.2)
        assert stats.num_running == 0 and stats.num_blocks_free == stats.num_blocks_total
        assert stats.num_generation_tokens - generated_before < 500  # stopped, not run to its end
        assert all(not r.in_flight for r in engine.router.replicas.values())



def test_n_completions_larger_than_a_replica_are_served_as_on_one_node(replicas):
    """4 × 400 tokens of one prompt exceed a replica's 1024-token cache, as they would exceed a
    single engine's, which runs them in turn; the router plans them on a whole replica."""
    with cluster_server(replicas, "coordinated") as (url, engine):
        response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 4, "max_tokens": 400,
                                                            "ignore_eos": True, "temperature": 1.0, "seed": 0},
                              timeout=120)
        assert response.status_code == 200, response.text
        body = response.json()
        assert len(body["choices"]) == 4 and body["usage"]["completion_tokens"] == 1600



@contextmanager
def stopped(actor) -> Iterator[None]:
    """The replica's process frozen (SIGSTOP), as a wedged step or a partitioned node leaves it."""
    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _replica_serving(engine: ClusterEngine) -> int:
    """The replica a lone request streams from, once it has its first token."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for replica_id, state in list(engine.router.replicas.items()):
            if any(e.has_first_token for e in list(state.in_flight.values())):
                return replica_id
        time.sleep(0.01)
    raise AssertionError("the request never started")


def test_a_replica_that_stops_answering_fails_its_streams_and_restarts_what_nobody_saw(replicas):
    """A replica that neither answers nor exits: after lost_after_s its stream ends with an error
    event and [DONE] (not a cut-off body), a non-streaming request starts again on the other
    replica and answers in full, and the replica rejoins once it answers again."""
    import threading

    actors, _ = replicas
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with cluster_server(replicas, "least-loaded", poll_timeout_s=0.5, lost_after_s=1.0) as (url, engine):
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            silent = _replica_serving(engine)
            with stopped(actors[silent]):
                rest = [line for line in lines if line.startswith("data:")]
                engine.refresh()
                replica = httpx.get(url + "/health", timeout=5).json()["replicas"][silent]
        assert not replica["alive"] and replica["running"] == 0  # its last report no longer counts
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["code"] == 500 and "stopped answering for 1 s" in error["message"]
        while not all(state.is_alive for state in list(engine.router.replicas.values())):
            time.sleep(0.05)

        answer: dict = {}
        thread = threading.Thread(target=lambda: answer.update(
            response=httpx.post(url + "/v1/completions", json=body, timeout=60)))
        thread.start()
        with stopped(actors[_replica_serving(engine)]):
            thread.join(60)
        assert answer["response"].status_code == 200, answer["response"].text
        assert answer["response"].json()["usage"]["completion_tokens"] == 400


BODIES = [
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 6, "logprobs": 3, "echo": True}),
    ("/v1/completions", {"prompt": "one two three", "max_tokens": 12, "stop": ["three"], "ignore_eos": True}),
    ("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 5, "prompt_logprobs": 2, "n": 2,
                         "temperature": 0.8, "seed": 3}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 8, "guided_regex": "[0-9]{3}-(ab|cd)", "min_tokens": 2,
                         "logit_bias": {"40": 5}, "bad_words": ["12"], "temperature": 0.8, "seed": 1}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 60, "response_format": {"type": "json_object"}}),
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 6, "n": 3, "use_beam_search": True}),
]


def _same(got, expected, path: str = "") -> None:
    """Equal, but floats (logprobs) only to 1e-3: the replicas compute on one thread."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), path
        for key in expected:
            # differ between any two calls; prefix-cache hits depend on what each engine served before
            if key not in ("id", "created", "prompt_tokens_details"):
                _same(got[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            _same(g, e, f"{path}[{i}]")
    elif isinstance(expected, float):
        assert got == pytest.approx(expected, abs=1e-3), path
    else:
        assert got == expected, path


def test_the_cluster_answers_as_one_engine_does(replicas, tiny_model_dir):
    """Same routes, same answers: each body through the cluster equals it through a single-node
    server over the same model and engine settings."""
    from engine.async_engine import AsyncEngine

    single = AsyncEngine(EngineConfig(str(tiny_model_dir), block_size=8, num_kv_blocks=128, max_num_seqs=4))
    single.start()
    try:
        with serve_in_thread(build_app(single, ServerConfig(served_model_name=MODEL))) as one, \
                cluster_server(replicas, "coordinated") as (many, _):
            for route, body in BODIES:
                answers = [httpx.post(url + route, json={"model": MODEL, "temperature": 0, **body}, timeout=60)
                           for url in (one, many)]
                assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
                _same(answers[1].json(), answers[0].json(), route)
    finally:
        single.shutdown()


def test_run_batch_on_two_replicas(tiny_model_dir, tmp_path):
    """`driftgate run-batch --replicas 2`: the batch's requests spread over the replicas, every line answered."""
    import json

    source, answers = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                          "body": {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}}) + "\n"
                              for i in range(6)))
    done = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run-batch", "-i", str(source), "-o", str(answers), str(tiny_model_dir),
         "--replicas", "2", "--kv-cache-memory-bytes", "4000000", "--log-level", "warning"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == [f"q{i}" for i in range(6)]
    assert all(r["response"]["status_code"] == 200 for r in records)
    # greedy and the same prompt: every replica gives the same answer
    assert len({r["response"]["body"]["choices"][0]["message"]["content"] for r in records}) == 1
