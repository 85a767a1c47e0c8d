"""The official `openai` client against a live server: the fields real clients send."""

from __future__ import annotations

import json
import logging
import re

import httpx
import openai
import pytest

from server.config import ServerConfig
from tests.server.conftest import MODEL_NAME, serve, wait_until_idle

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_completion_greedy_is_deterministic_and_reports_usage(client):
    first = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    second = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = first.choices[0]
    assert choice.text == second.choices[0].text
    assert choice.finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens > 0
    assert 0 < first.usage.completion_tokens <= 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens


def test_completion_stream_matches_non_stream(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, route):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens streamed
    up to it, so a client can bill or cut off mid-stream; the last usage chunk is the total."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    common = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0, "stream": True, "stream_options": options,
              "extra_body": {"ignore_eos": True}}
    chunks = list(client.completions.create(prompt=PROMPT, **common) if route == "completions"
                  else client.chat.completions.create(messages=MESSAGES, **common))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 12
    assert len(set(counts)) > 1 and chunks[-1].usage.completion_tokens == 12
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    plain = list(client.completions.create(prompt=PROMPT, **{**common, "stream_options": {"include_usage": True}}))
    assert all(c.usage is None for c in plain if c.choices)  # only when asked for


def test_chat_stream_matches_non_stream(client):
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=16,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n_greater_than_one(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, n=2, temperature=1.0)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=2, stream=True))
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}


def test_stop_string_truncates(client):
    free = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(free) > 4
    stop = free[len(free) // 2: len(free) // 2 + 2]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop  # vLLM's field: which stop ended it
    assert out.text == free[: free.index(stop)]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=24, temperature=0, stop=[stop])
    length = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0).choices[0]
    assert chat.choices[0].stop_reason in (stop, None) and length.stop_reason is None
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                              stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert [c.choices[0].stop_reason for c in streamed if c.choices][-1] == stop


def test_a_stream_never_shows_the_start_of_a_stop_string(client):
    """A stop string spanning tokens: its first tokens must not reach the stream before the last
    completes it (the final text is cut before it, and a stream cannot take text back), on both
    routes; the streamed text equals the unstreamed one."""
    free = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2: len(free) // 2 + 8]  # several tokens of the tiny model's text
    common = {"model": MODEL_NAME, "max_tokens": 24, "temperature": 0, "stop": [stop, "never said"],
              "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(prompt=PROMPT, **common).choices[0].text
    assert whole == free[: free.index(stop)]
    streamed = client.completions.create(prompt=PROMPT, stream=True, **common)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole
    chat = {**common, "messages": MESSAGES}
    free_chat = client.chat.completions.create(**{**chat, "stop": None}).choices[0].message.content
    chat["stop"] = [free_chat[len(free_chat) // 2: len(free_chat) // 2 + 8]]
    whole_chat = client.chat.completions.create(**chat).choices[0].message.content
    streamed_chat = client.chat.completions.create(stream=True, **chat)
    assert "".join(c.choices[0].delta.content or "" for c in streamed_chat if c.choices) == whole_chat


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0
        assert 2 <= len(top) <= 3 and top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token


def test_echo_with_logprobs_returns_prompt_logprobs_first_null(client, base_url):
    prompt_ids = httpx.post(base_url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()["tokens"]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1,
                                    echo=True)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(PROMPT)
    assert len(lp.token_logprobs) == len(prompt_ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])


def test_prompt_logprobs_list_each_prompt_token_with_its_rank(client, base_url):
    """vLLM's prompt_logprobs: per prompt token (the first none) the token and the top n by id,
    each with logprob, rank and text; the logprobs are echo's, ranks 1..n for the top ones and the
    prompt token's true place. The chat route returns them for its rendered prompt."""
    prompt_ids = httpx.post(base_url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()["tokens"]
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3, "echo": True, "logprobs": 1}
    choice = httpx.post(base_url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    listed, echoed = choice["prompt_logprobs"], choice["logprobs"]
    assert len(listed) == len(prompt_ids) and listed[0] is None
    for t in range(1, len(prompt_ids)):
        entries = {int(k): v for k, v in listed[t].items()}
        mine = entries[prompt_ids[t]]
        assert mine["logprob"] == pytest.approx(echoed["token_logprobs"][t])
        assert mine["decoded_token"] == echoed["tokens"][t]
        top = sorted((v for k, v in entries.items() if k != prompt_ids[t] or v["rank"] <= 3),
                     key=lambda v: v["rank"])
        assert [v["rank"] for v in top] == [1, 2, 3]
        assert [v["logprob"] for v in top] == sorted((v["logprob"] for v in top), reverse=True)
        better = sum(v["logprob"] > mine["logprob"] for v in top)
        assert mine["rank"] == better + 1 if better < 3 else mine["rank"] > 3
        assert len(entries) == 3 + (mine["rank"] > 3)
    chat = httpx.post(base_url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1,
                                                               "prompt_logprobs": 0}, timeout=30).json()
    chat_ids = httpx.post(base_url + "/tokenize", json={"messages": MESSAGES}, timeout=10).json()["tokens"]
    assert len(chat["prompt_logprobs"]) == len(chat_ids) and chat["prompt_logprobs"][0] is None
    assert all(list(e) == [str(t)] for e, t in zip(chat["prompt_logprobs"][1:], chat_ids[1:], strict=True))
    for route, extra in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        for fields in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1},
                       {"prompt_logprobs": 1, "use_beam_search": True, "n": 2}):
            refused = httpx.post(base_url + route, json={**extra, **fields}, timeout=10)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs", fields
    refused = httpx.post(base_url + "/v1/completions", json={"prompt": PROMPT, "logprobs": 21}, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"
    assert "--max-logprobs" in refused.json()["error"]["message"]


def test_return_token_ids_give_the_prompt_and_output_ids(client, base_url):
    """vLLM's return_token_ids: the prompt's ids and each choice's output ids beside the text; a
    stream carries the prompt's on its first chunk and each chunk's own new ids."""
    prompt_ids = httpx.post(base_url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()["tokens"]
    extra = {"return_token_ids": True, "ignore_eos": True}
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=extra)
    choice = full.choices[0].model_dump()
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 6
    assert httpx.post(base_url + "/detokenize", json={"tokens": choice["token_ids"]},
                      timeout=10).json()["prompt"] == choice["text"]
    chunks = [c.model_dump() for c in client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6,
                                                                temperature=0, stream=True, extra_body=extra)]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]

    chat_ids = httpx.post(base_url + "/tokenize", json={"messages": MESSAGES}, timeout=10).json()["tokens"]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                           extra_body=extra).model_dump()
    assert reply["prompt_token_ids"] == chat_ids and len(reply["choices"][0]["token_ids"]) == 6
    streamed = [c.model_dump() for c in client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0, stream=True, extra_body=extra)]
    assert streamed[0]["prompt_token_ids"] == chat_ids
    assert all(c.get("prompt_token_ids") is None for c in streamed[1:])
    assert [t for c in streamed for t in (c["choices"][0].get("token_ids") or [])] == reply["choices"][0]["token_ids"]
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2).choices[0].model_dump()
    assert plain.get("token_ids") is None and plain.get("prompt_token_ids") is None


def test_tokens_as_token_ids_name_the_exact_ids(client, base_url):
    """vLLM's `return_tokens_as_token_ids`: the ids, not texts that may not re-encode to them."""
    prompt_ids = httpx.post(base_url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()["tokens"]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                    echo=True, extra_body={"return_tokens_as_token_ids": True})
    lp = out.choices[0].logprobs
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert all(t.startswith("token_id:") for t in lp.tokens)
    assert ids[:len(prompt_ids)] == prompt_ids
    assert httpx.post(base_url + "/detokenize", json={"tokens": ids[len(prompt_ids):]},
                      timeout=10).json()["prompt"] == out.choices[0].text[len(PROMPT):]
    for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True):
        assert token in top and all(k.startswith("token_id:") for k in top)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)


def test_token_id_and_batched_prompts(client):
    ids = [5, 6, 7, 8]
    single = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    batch = client.completions.create(model=MODEL_NAME, prompt=[ids, [9, 10]], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == single.choices[0].text
    assert batch.usage.prompt_tokens == 6


def _token_ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def test_logit_bias_allowed_token_ids_and_bad_words(client, engine):
    ids_of = {"return_tokens_as_token_ids": True}
    forced = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                                       logit_bias={"42": 100}, extra_body=ids_of)
    assert _token_ids(forced.choices[0]) == [42] * 4
    sampled = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, logprobs=0,
                                        extra_body={**ids_of, "allowed_token_ids": [40, 41]})
    assert set(_token_ids(sampled.choices[0])) <= {40, 41}
    word = engine.tokenizer.decode([42])
    banned = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                                       logit_bias={"42": 100}, extra_body={**ids_of, "bad_words": [word]})
    assert 42 not in _token_ids(banned.choices[0])
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, temperature=0,
                                          logit_bias={"42": 100})
    assert chat.choices[0].message.content == word * 3


def test_structured_outputs_through_every_field(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert set(json.loads(chat.choices[0].message.content)) == {"ok"}, chat.choices[0]
    mode = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0,
                                          response_format={"type": "json_object"})
    assert mode.choices[0].finish_reason == "length" or isinstance(json.loads(mode.choices[0].message.content), dict)
    choices = ["Paris", "Lyon"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3,
                                        extra_body=extra)
        assert {c.text for c in out.choices} <= set(choices)
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       extra_body={"guided_regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", "".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<answer>", "end": "</answer>",
                                                "content": {"type": "regex", "pattern": "(yes|no)"}}}
    tagged = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=0,
                                            response_format=tag)  # vLLM's extension of response_format
    assert tagged.choices[0].message.content in ("<answer>yes</answer>", "<answer>no</answer>"), tagged.choices[0]


def test_models_tokenize_detokenize_version(base_url):
    with httpx.Client(base_url=base_url, timeout=10) as http:
        models = http.get("/v1/models").json()
        assert models["data"][0]["id"] == MODEL_NAME and models["data"][0]["max_model_len"] > 0
        tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0
        assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
        chat_tokens = http.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat_tokens["count"] > tokens["count"]
        assert http.get("/version").json()["version"]
        assert http.get("/tokenizer_info").json()["eos_token"]


def test_retrieve_a_model_as_openai_clients_do(client, engine):
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        client.models.retrieve("gpt-4o")
    with serve(engine, aliases=("org/model-v1",)) as url, httpx.Client(base_url=url, timeout=10) as http:
        card = http.get("/v1/models/org/model-v1").json()  # a hub-style name keeps its slash
        assert card["id"] == "org/model-v1" and card["object"] == "model"
        missing = http.get("/v1/models/org")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_token_count_and_queue_time_histograms(engine):
    """vLLM's request_prompt_tokens / request_generation_tokens: one observation per finished sample;
    request_queue_time_seconds: one per engine request (its n samples are admitted together)."""
    with serve(engine) as url:
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "n": 2, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in ("driftgate:request_prompt_tokens_count 2.0", "driftgate:request_prompt_tokens_sum 10.0",
                 'driftgate:request_prompt_tokens_bucket{le="5.0"} 2.0', 'driftgate:request_prompt_tokens_bucket{le="2.0"} 0.0',
                 "driftgate:request_generation_tokens_sum 6.0", "driftgate:request_queue_time_seconds_count 1.0"):
        assert line in text, line


def test_metrics_exposition(client, base_url):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4)
    text = httpx.get(base_url + "/metrics", timeout=10).text
    for name in ("driftgate:num_requests_running", "driftgate:num_requests_waiting", "driftgate:kv_cache_usage_perc",
                 "driftgate:prefix_cache_hit_rate", "driftgate:num_preemptions_total",
                 "driftgate:time_to_first_token_seconds_bucket", "driftgate:inter_token_latency_seconds_bucket",
                 "driftgate:e2e_request_latency_seconds_count", "driftgate:request_success_total"):
        assert name in text, name
    assert 'driftgate:http_requests_total{route="/v1/completions",status="200"}' in text


def test_fields_left_out_take_the_model_generation_config(engine):
    from tests.server.conftest import serve

    def complete(url: str, **fields) -> dict:
        body = {"prompt": "Once upon a", "max_tokens": 12, "ignore_eos": True, **fields}
        return httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]

    with serve(engine, sampling_defaults={"temperature": 0.0}) as url:
        greedy = complete(url, temperature=0.0)["text"]
        assert [complete(url)["text"] for _ in range(2)] == [greedy, greedy]  # the config's temperature 0
        # a field the request sends wins: sampled at temperature 1 with different seeds, the texts differ
        assert len({complete(url, temperature=1.0, seed=s)["text"] for s in range(4)}) > 1
    with serve(engine, sampling_defaults={"max_tokens": 3}) as url:  # max_new_tokens: a cap on every request
        capped = httpx.post(url + "/v1/completions", json={"prompt": "Once upon a", "max_tokens": 12, "ignore_eos": True},
                            timeout=60).json()
        assert capped["usage"]["completion_tokens"] == 3 and capped["choices"][0]["finish_reason"] == "length"
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 12, "ignore_eos": True}, timeout=60).json()
        assert chat["usage"]["completion_tokens"] == 3 and chat["choices"][0]["finish_reason"] == "length"


def test_chat_template_given_to_the_server_replaces_the_tokenizers(engine):
    from tests.server.conftest import serve

    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    messages = [{"role": "user", "content": "hi there"}]
    with serve(engine, chat_template=template) as url:
        ids = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
        assert ids == engine.tokenizer.encode("user: hi there\nassistant:", add_special_tokens=False)
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 3}, timeout=60)
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(ids)
        # what lm-eval's remote tokenizer reads to format chats itself
        assert httpx.get(url + "/tokenizer_info", timeout=10).json()["chat_template"] == template


def test_chat_template_options_reach_the_template(engine, base_url):
    from tests.server.conftest import serve

    def tokenize(url: str, **fields) -> httpx.Response:
        return httpx.post(url + "/tokenize", json=fields, timeout=30)

    tok = engine.tokenizer
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    ids = tokenize(base_url, messages=turns, add_generation_prompt=False, continue_final_message=True).json()["tokens"]
    assert tok.decode(ids).endswith("The answer is")  # the turn left open for the model to go on
    closed = tokenize(base_url, messages=turns, add_generation_prompt=False).json()["tokens"]
    assert len(closed) > len(ids) and closed[:len(ids) - 1] == ids[:-1]
    both = tokenize(base_url, messages=turns, continue_final_message=True)  # add_generation_prompt defaults true
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    body = {"messages": turns, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 2}
    assert httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]["prompt_tokens"] \
        == len(ids)

    with serve(engine, chat_template="{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}") as url:
        loud = tokenize(url, messages=turns[:1], chat_template_kwargs={"shout": True}).json()["tokens"]
        assert loud == tok.encode("LOUD hi", add_special_tokens=False)
        clash = tokenize(url, messages=turns[:1], chat_template_kwargs={"tokenize": True})
        assert clash.status_code == 400 and "tokenize" in clash.json()["error"]["message"]
    # serve --default-chat-template-kwargs: every chat gets them, a request's own override them
    with serve(engine, chat_template="{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}",
               default_chat_template_kwargs={"shout": True}) as url:
        assert tokenize(url, messages=turns[:1]).json()["tokens"] == loud
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": turns[:1], "max_tokens": 1}, timeout=60)
        assert chat.json()["usage"]["prompt_tokens"] == len(loud)
        quiet = tokenize(url, messages=turns[:1], chat_template_kwargs={"shout": False}).json()["tokens"]
        assert quiet == tok.encode("hi", add_special_tokens=False)
    with pytest.raises(ValueError, match="default chat template kwargs may not set add_generation_prompt"):
        ServerConfig(served_model_name="m", default_chat_template_kwargs={"add_generation_prompt": False})
    # OpenAI's reasoning_effort (Responses' reasoning.effort, Anthropic's output_config.effort) is the
    # template's variable, as in vLLM
    effort_template = "effort {{ reasoning_effort | default('unset') }}: {{ messages[-1]['content'] }}"
    with serve(engine, chat_template=effort_template) as url:
        def prompt_tokens(route: str, **fields) -> int:
            reply = httpx.post(url + route, json={"max_tokens": 1, "max_output_tokens": 1, **fields}, timeout=60)
            assert reply.status_code == 200, reply.text
            usage = reply.json()["usage"]
            return usage.get("prompt_tokens", usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0))

        for effort in ("low", "medium"):
            expected = len(tok.encode(f"effort {effort}: hi", add_special_tokens=False))
            assert prompt_tokens("/v1/chat/completions", messages=turns[:1], reasoning_effort=effort) == expected
            assert prompt_tokens("/v1/responses", input="hi", reasoning={"effort": effort, "summary": "auto"}) \
                == expected
            assert prompt_tokens("/v1/messages", messages=turns[:1], output_config={"effort": effort}) == expected
        assert prompt_tokens("/v1/chat/completions", messages=turns[:1]) == \
            len(tok.encode("effort unset: hi", add_special_tokens=False))
        bad = httpx.post(url + "/v1/chat/completions", json={"messages": turns[:1], "reasoning_effort": "max"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


def test_truncate_prompt_tokens_keeps_the_last_ones(engine, base_url):
    ids = list(range(100, 140))
    body = {"prompt": ids, "max_tokens": 1, "echo": True, "truncate_prompt_tokens": 8}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=60).json()
    assert r["usage"]["prompt_tokens"] == 8
    assert r["choices"][0]["text"].startswith(engine.tokenizer.decode(ids[-8:]))  # echo: what the model saw
    chat = {"messages": [{"role": "user", "content": "hello " * 30}], "max_tokens": 1, "truncate_prompt_tokens": 5}
    assert httpx.post(base_url + "/v1/chat/completions", json=chat, timeout=60).json()["usage"]["prompt_tokens"] == 5


def test_aliases_are_accepted_and_listed(engine):
    from tests.server.conftest import serve

    with serve(engine, aliases=("gpt-3.5-turbo",)) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "gpt-3.5-turbo", "prompt": "hi", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200 and r.json()["model"] == MODEL_NAME  # responses use the first name
        assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == [MODEL_NAME,
                                                                                             "gpt-3.5-turbo"]
        unknown = httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "hi"}, timeout=10)
        assert unknown.status_code == 404 and "'gpt-3.5-turbo'" in unknown.json()["error"]["message"]


def test_speculative_decoding_streams_what_plain_decoding_returns(tiny_model_dir, base_url):
    """Steps that keep drafts send several tokens at once: the stream, its logprobs and the
    counters still match a server without drafts, token for token."""
    from engine import AsyncEngine, EngineConfig
    from tests.server.conftest import serve

    body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}
    plain = httpx.post(base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    spec = AsyncEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, speculative_config={
        "num_speculative_tokens": 3, "prompt_lookup_min": 1}))
    spec.start()
    try:
        with serve(spec) as url:
            lines = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60).text.splitlines()
            chunks = [json.loads(line[6:])["choices"][0] for line in lines if line.startswith("data: {")]
            metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        spec.shutdown()
    assert "".join(c["text"] for c in chunks) == plain["text"]
    assert sum((c["logprobs"]["tokens"] for c in chunks), []) == plain["logprobs"]["tokens"]
    assert len(chunks) < 40  # some chunks carried accepted drafts
    accepted = re.search(r"^driftgate:spec_decode_num_accepted_tokens_total (\S+)", metrics, re.M)
    assert accepted and float(accepted.group(1)) > 0


def test_priority_is_refused_without_the_priority_policy_and_served_with_it(tiny_model_dir, base_url):
    from engine import AsyncEngine, EngineConfig
    from tests.server.conftest import serve

    body = {"model": MODEL_NAME, "prompt": "Once upon a", "max_tokens": 2, "priority": 3}
    refused = httpx.post(base_url + "/v1/completions", json=body, timeout=30)
    assert refused.status_code == 400 and "--scheduling-policy priority" in refused.json()["error"]["message"]
    assert httpx.post(base_url + "/v1/completions", json={**body, "priority": 0}, timeout=30).status_code == 200
    ranked = AsyncEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=1,
                                      scheduling_policy="priority"))
    ranked.start()
    try:
        with serve(ranked) as url:
            chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                    "priority": -5}
            assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
            assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
            bad = httpx.post(url + "/v1/completions", json={**body, "priority": "high"}, timeout=30)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    finally:
        ranked.shutdown()


def test_beam_search_returns_the_engines_best_beams(client, base_url, engine, tiny_model_dir):
    """use_beam_search with n beams: the n hypotheses LLM.beam_search finds, best first, on both
    routes, streamed or not; sampling fields are ignored (beam search does not sample)."""
    from engine import LLM
    from engine.beam_search import BeamSearchParams
    from engine.outputs import CompletionOutput

    prompt = engine.tokenizer.encode(PROMPT)
    found = LLM(str(tiny_model_dir)).beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=8))[0]
    # each choice is what a sequence generated, its EOS among the ids (vLLM's sequences leave it out)
    expected = [CompletionOutput(i, engine.tokenizer.decode(s.tokens[len(prompt):], skip_special_tokens=True),
                                 s.tokens[len(prompt):] + ([s.stop_reason] if s.finish_reason == "stop" else []),
                                 s.logprobs, s.finish_reason, s.stop_reason, s.cum_logprob)
                for i, s in enumerate(found.sequences)]
    extra = {"use_beam_search": True, "length_penalty": 1.0}
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3, temperature=0.7,
                                    extra_body=extra)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [c.text for c in expected]
    assert [c.finish_reason for c in out.choices] == [c.finish_reason for c in expected]
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in expected)
    # with logprobs (as vLLM gives them): each token's, and the step's top alternatives, best first
    scored = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3, logprobs=2,
                                       extra_body={**extra, "return_tokens_as_token_ids": True})
    for choice, beam in zip(sorted(scored.choices, key=lambda c: c.index), expected, strict=True):
        mine = [lp[t] for t, lp in zip(beam.token_ids, beam.logprobs, strict=True)]
        assert choice.logprobs.token_logprobs == pytest.approx(mine, abs=1e-5)
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(beam.cumulative_logprob, abs=1e-4)
        assert all(2 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)  # the top 2, and the token
    chat_scored = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, n=2,
                                                 logprobs=True, top_logprobs=2, extra_body=extra)
    assert all(c.logprobs.content and all(len(item.top_logprobs) == 2 for item in c.logprobs.content)
               for c in chat_scored.choices)
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3, stream=True,
                                              extra_body=extra))
    texts = ["".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in expected]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, n=2, extra_body=extra)
    assert len(chat.choices) == 2 and all(c.message.content is not None for c in chat.choices)
    refused = httpx.post(base_url + "/v1/chat/completions", json={"messages": MESSAGES, "use_beam_search": True,
                                                                  "response_format": {"type": "json_object"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
    wait_until_idle(engine)  # every beam's one-token requests ended and freed their blocks


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client):
    prompt = [(17 * i) % 300 + 40 for i in range(40)]  # 40 tokens no other test sends
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32  # the two full 16-token blocks
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
    chat = [{"role": "user", "content": "Repeat after me: " + "la " * 30}]
    client.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=2)
    assert client.chat.completions.create(model=MODEL_NAME, messages=chat,
                                          max_tokens=2).usage.prompt_tokens_details.cached_tokens >= 16


def test_cache_salt_keeps_tenants_out_of_each_others_prefix_cache(client, base_url):
    """vLLM's cache_salt: a prompt cached under one salt is no hit under another or none, and is
    one under the same salt; the answer is the same throughout. An empty salt is a 400."""
    prompt = [(19 * i) % 300 + 35 for i in range(40)]  # 40 tokens no other test sends

    def complete(salt):
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0,
                                        extra_body={} if salt is None else {"cache_salt": salt})
        return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens

    first, cached = complete("tenant-a")
    assert cached == 0
    assert complete("tenant-b") == (first, 0)
    assert complete(None) == (first, 0)
    assert complete("tenant-a") == (first, 32)
    chat = [{"role": "user", "content": "Say it again: " + "da " * 30}]
    answers = [client.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=2,
                                              extra_body={"cache_salt": "tenant-c"}) for _ in range(2)]
    assert [a.usage.prompt_tokens_details.cached_tokens >= 16 for a in answers] == [False, True]
    refused = httpx.post(base_url + "/v1/completions", json={"prompt": "hi", "cache_salt": ""})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"


def test_sagemaker_invocations_answer_as_the_route_the_body_names(client, base_url):
    """SageMaker's contract (vLLM serves it): /ping is the health check, /invocations routes a
    body by its fields to chat, completions or embeddings and answers exactly as they do; a body
    naming none, or not JSON, or invalid for its route, is a 400."""
    for method in ("GET", "POST"):
        assert httpx.request(method, base_url + "/ping", timeout=10).json()["status"] == "ok"
    for route, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}),
                        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, "temperature": 0}),
                        ("/v1/embeddings", {"input": PROMPT})):
        invoked = httpx.post(base_url + "/invocations", json=body, timeout=30).json()
        direct = httpx.post(base_url + route, json=body, timeout=30).json()
        assert invoked["object"] == direct["object"]
        assert invoked["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]  # the second hits the cache
        if route == "/v1/embeddings":
            assert invoked["data"] == direct["data"]
        else:
            assert invoked["choices"] == direct["choices"]
    for body, param in (({"max_tokens": 5}, None), ({"messages": "hi"}, "messages"),
                        ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens")):
        refused = httpx.post(base_url + "/invocations", json=body, timeout=10)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    refused = httpx.post(base_url + "/invocations", content=b"{not json", timeout=10)
    assert refused.status_code == 400 and "JSON object" in refused.json()["error"]["message"]


def test_enable_log_requests_logs_each_prompt_cut_to_max_log_len(engine, base_url, caplog):
    """serve --enable-log-requests: a JSON line per engine request with its prompt (cut to
    --max-log-len characters and token ids) and the sampling fields it set; off by default."""
    from tests.server.conftest import serve

    def logged() -> list[dict]:
        return [json.loads(r.getMessage()) for r in caplog.records if r.name == "driftgate.server.requests"]

    body = {"model": MODEL_NAME, "prompt": ["The secret word is banana", "Two"], "max_tokens": 3, "temperature": 0.5}
    caplog.set_level(logging.INFO, logger="driftgate.server.requests")
    assert httpx.post(base_url + "/v1/completions", json=body, timeout=60).status_code == 200
    assert logged() == []
    with serve(engine, log_requests=True, max_log_len=10) as url:
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    lines = logged()
    assert len(lines) == 2 and lines[0]["id"] != lines[1]["id"]
    first = lines[0] if lines[0]["prompt_tokens"] > lines[1]["prompt_tokens"] else lines[1]
    ids = engine.tokenizer.encode("The secret word is banana")
    assert first["prompt_tokens"] == len(ids) and first["prompt_token_ids"] == ids[:10]
    assert first["prompt"] == engine.tokenizer.decode(ids[:10])[:10]
    assert sum(line["prompt_tokens"] for line in lines) == reply["usage"]["prompt_tokens"]
    assert first["params"]["temperature"] == 0.5 and first["params"]["max_tokens"] == 3
    assert "top_p" not in first["params"]  # only the fields the request moved off their defaults
