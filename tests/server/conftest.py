"""Live servers on the real engine over a tiny random model, shared across the server tests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from server.app import build_app
from server.config import ServerConfig
from tests.server.live import serve_in_thread

MODEL_NAME = "tiny"


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path):
    from engine import AsyncEngine, EngineConfig

    eng = AsyncEngine(EngineConfig(model=str(tiny_model_dir), max_num_seqs=8, max_num_batched_tokens=512,
                                    num_kv_blocks=512, seed=0))
    eng.start()
    yield eng
    eng.shutdown()


@contextmanager
def serve(engine, **config) -> Iterator[str]:
    """A live server over the shared engine with these `ServerConfig` fields."""
    with serve_in_thread(build_app(engine, ServerConfig(served_model_name=MODEL_NAME, **config))) as url:
        yield url


@pytest.fixture(scope="session")
def base_url(engine) -> Iterator[str]:
    with serve(engine, request_timeout_s=60) as url:
        yield url


@pytest.fixture
def client(base_url: str):
    import openai

    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def wait_until_idle(engine, timeout_s: float = 10.0) -> float:
    """Seconds until the engine holds no request and no KV block; fails the test past the timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_blocks_used == 0:
            return time.monotonic() - start
        time.sleep(0.01)
    pytest.fail(f"engine still busy after {timeout_s} s: {engine.stats()}")
