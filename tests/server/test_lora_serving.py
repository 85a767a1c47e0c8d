"""LoRA adapters served as models of their own over one base model (vLLM's --lora-modules)."""

from __future__ import annotations

import json

import httpx
import pytest

from engine import LLM, LoRARequest, SamplingParams
from server.cli import lora_modules
from tests.server.conftest import MODEL_NAME, serve

PROMPT = [5 + (7 * j) % 300 for j in range(24)]


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir, tiny_lora_dir):
    from engine import AsyncEngine, EngineConfig

    eng = AsyncEngine(EngineConfig(model=str(tiny_model_dir), max_num_seqs=8, num_kv_blocks=128,
                                   lora_modules={"sql": str(tiny_lora_dir)}))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def lora_url(lora_engine, tiny_lora_dir):
    with serve(lora_engine, lora_modules={"sql": str(tiny_lora_dir)}) as url:
        yield url


def test_a_request_naming_the_adapter_is_served_by_it(lora_url, tiny_model_dir, tiny_lora_dir):
    """`model: sql` answers as the engine with that adapter does, the base name as the base
    model; the adapter is a model card of its own, its parent the base."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    offline = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True)
    expected = {name: offline.generate([PROMPT], greedy, use_tqdm=False, lora_request=request)[0].outputs[0].text
                for name, request in (("sql", LoRARequest("sql", 1, str(tiny_lora_dir))), (MODEL_NAME, None))}
    assert expected["sql"] != expected[MODEL_NAME]
    for model, text in expected.items():
        for stream in (False, True):
            body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "stream": stream}
            with httpx.stream("POST", lora_url + "/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line.strip()]
            if stream:
                chunks = [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]
                assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
                assert {c["model"] for c in chunks} == {model}
            else:
                reply = json.loads("".join(lines))
                assert reply["choices"][0]["text"] == text and reply["model"] == model
    chat = httpx.post(lora_url + "/v1/chat/completions", json={"model": "sql", "max_tokens": 3,
                                                               "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "sql"
    cards = {card["id"]: card for card in httpx.get(lora_url + "/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == MODEL_NAME and cards["sql"]["root"] == str(tiny_lora_dir)
    assert cards[MODEL_NAME]["parent"] is None
    unknown = httpx.post(lora_url + "/v1/completions", json={"model": "nosql", "prompt": "hi"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert "'sql'" in unknown.json()["error"]["message"]
    info = [line for line in httpx.get(lora_url + "/metrics").text.splitlines()
            if line.startswith("driftgate:lora_requests_info{")]  # vLLM's, for LoRA-aware gateways
    assert len(info) == 1 and 'max_lora="1"' in info[0] and 'running_lora_adapters=""' in info[0], info


def test_lora_modules_arguments_are_checked(tmp_path):
    (tmp_path / "adapter").mkdir()
    assert lora_modules([f"a={tmp_path / 'adapter'}"]) == {"a": str((tmp_path / "adapter").resolve())}
    for specs, message in ((["a"], "NAME=PATH"), ([f"a={tmp_path / 'none'}"], "folder not found"),
                           ([f"a={tmp_path / 'adapter'}", f"a={tmp_path / 'adapter'}"], "twice")):
        with pytest.raises(ValueError, match=message):
            lora_modules(specs)


def test_adapters_load_and_unload_at_run_time_when_allowed(lora_engine, lora_url, tiny_lora_dir, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: off unless allowed; a loaded
    adapter is a model until unloaded; adapters given at start stay."""
    body = {"lora_name": "sql2", "lora_path": str(tiny_lora_dir)}
    off = httpx.post(lora_url + "/v1/load_lora_adapter", json=body)
    assert off.status_code == 400 and "--allow-runtime-lora-updating" in off.json()["error"]["message"]
    with serve(lora_engine, lora_modules={"sql": str(tiny_lora_dir)}, allow_runtime_lora_updating=True) as url:
        loaded = httpx.post(url + "/v1/load_lora_adapter", json=body)
        assert loaded.status_code == 200 and "sql2" in loaded.text
        assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == 400  # already loaded
        completion = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        texts = {m: httpx.post(url + "/v1/completions", json={**completion, "model": m}, timeout=30).json()
                 ["choices"][0]["text"] for m in ("sql", "sql2")}
        assert texts["sql"] == texts["sql2"]  # the same folder under two names
        assert {c["id"] for c in httpx.get(url + "/v1/models").json()["data"]} == {MODEL_NAME, "sql", "sql2"}
        bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        assert "adapter_config.json" in bad.json()["error"]["message"]
        kept = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert kept.status_code == 400 and "stays" in kept.json()["error"]["message"]
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "sql2"}).status_code == 200
        gone = httpx.post(url + "/v1/completions", json={**completion, "model": "sql2"})
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "sql2"}).status_code == 404
