"""`driftgate run-batch`: an OpenAI batch file answered line by line, as `serve` answers each request."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.cli import main
from tests.server.test_openai_api import MESSAGES

CHAT = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
RESPONSE = {"input": "Say hello.", "max_output_tokens": 10, "temperature": 0}
EMBEDDING = {"input": ["The capital of France", "Paris"]}
SCORE = {"text_1": "The capital of France", "text_2": ["Paris", "Berlin"]}


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_each_line_gets_what_serve_answers_and_bad_lines_say_why(tmp_path, tiny_model_dir, base_url, capsys):
    lines = [
        _line("chat", "/v1/chat/completions", CHAT),
        _line("completion", "/v1/completions", COMPLETION),
        "not json",
        "",  # blank lines are skipped, and do not shift the line numbers errors name
        _line("bad-field", "/v1/chat/completions", {**CHAT, "temperature": -1}),
        _line("speech", "/v1/audio/speech", {"input": "x"}),
        _line("streamed", "/v1/completions", {**COMPLETION, "stream": True}),
        _line("response", "/v1/responses", RESPONSE),
        _line("embeddings", "/v1/embeddings", EMBEDDING),
        _line("score", "/v1/score", SCORE),
    ]
    source, answers = tmp_path / "in.jsonl", tmp_path / "out" / "answers.jsonl"
    source.write_text("\n".join(lines) + "\n")
    assert main(["run-batch", "-i", str(source), "-o", str(answers), str(tiny_model_dir), "--log-level", "warning"]) == 0
    assert "5 answered, 4 failed" in capsys.readouterr().err
    records = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["chat", "completion", None, "bad-field", "speech", "streamed",
                                                 "response", "embeddings", "score"]
    assert len({r["id"] for r in records}) == len(records)
    by_id = {r["custom_id"]: r for r in records}
    # the answers serve gives the same bodies (greedy, and batching does not change outputs here)
    for custom_id, url, body, field in (("chat", "/v1/chat/completions", CHAT, "choices"),
                                        ("completion", "/v1/completions", COMPLETION, "choices"),
                                        ("response", "/v1/responses", RESPONSE, "output_text"),
                                        ("embeddings", "/v1/embeddings", EMBEDDING, "data"),
                                        ("score", "/v1/score", SCORE, "data")):
        served = httpx.post(base_url + url, json=body, timeout=60).json()
        response = by_id[custom_id]["response"]
        assert response["status_code"] == 200 and by_id[custom_id]["error"] is None
        assert response["request_id"] == response["body"]["id"]
        if field == "output_text":  # the Responses body's text, item ids aside
            assert [c["text"] for c in response["body"]["output"][0]["content"]] == \
                [c["text"] for c in served["output"][0]["content"]]
        elif field == "data":  # pooled floats: equal within rounding, whatever shares their batch
            key = "score" if custom_id == "score" else "embedding"
            for item, reference in zip(response["body"]["data"], served["data"], strict=True):
                assert item[key] == pytest.approx(reference[key], abs=1e-5)
        else:
            assert response["body"][field] == served[field]
    # a bad field is that request's own 400, with the server's error body
    bad = by_id["bad-field"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "temperature"
    # lines that are no request: an error naming the line, no response
    assert records[2]["error"]["message"].startswith("line 3: not valid JSON")
    assert by_id["speech"]["error"]["message"].startswith("line 6: url must be one of")
    assert by_id["streamed"]["error"]["message"] == "line 7: a batch answers whole; stream must be false"
    assert all(r["response"] is None for r in (records[2], by_id["speech"], by_id["streamed"]))


def test_a_missing_input_or_model_is_one_line_and_exit_2(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(out), str(tiny_model_dir)]) == 2
    assert "missing.jsonl: batch input file not found" in capsys.readouterr().err
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"custom_id": "caf\xe9"}\n')
    assert main(["run-batch", "-i", str(latin), "-o", str(out), str(tiny_model_dir)]) == 2
    assert "latin.jsonl: not UTF-8 text" in capsys.readouterr().err
    source = tmp_path / "in.jsonl"
    source.write_text(_line("x", "/v1/completions", COMPLETION) + "\n")
    assert main(["run-batch", "-i", str(source), "-o", str(out), str(tmp_path / "no-model")]) == 2
    assert "model folder not found" in capsys.readouterr().err
    assert not out.exists()
    # an output that cannot be written is found before any request is answered, not after
    assert main(["run-batch", "-i", str(source), "-o", str(latin / "answers.jsonl"), str(tiny_model_dir)]) == 2
    assert f"{latin} is a file, not a folder" in capsys.readouterr().err
    assert main(["run-batch", "-i", str(source), "-o", str(tmp_path), str(tiny_model_dir)]) == 2
    assert f"{tmp_path} is a folder; give a file name" in capsys.readouterr().err


def test_an_unforeseen_error_is_its_lines_500_and_the_rest_are_answered(tmp_path, tiny_model_dir, monkeypatch,
                                                                        capsys):
    """An error the routes did not foresee (here a sampler fault) ends as that line's 500 with the
    server's error body; the batch still writes every line's answer."""
    import engine.sampler

    def fault(*args):
        raise RuntimeError("sampler fault")

    monkeypatch.setattr(engine.sampler, "_filter", fault)
    source, answers = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(_line("faulty", "/v1/completions", {**COMPLETION, "temperature": 1, "top_k": 5}) + "\n")
    assert main(["run-batch", "-i", str(source), "-o", str(answers), str(tiny_model_dir), "--log-level", "error"]) == 0
    [record] = [json.loads(line) for line in answers.read_text().splitlines()]
    assert record["custom_id"] == "faulty" and record["response"]["status_code"] == 500
    assert record["response"]["body"]["error"]["message"] == "internal server error"
    source.write_text(_line("fine", "/v1/completions", COMPLETION) + "\n")
    assert main(["run-batch", "-i", str(source), "-o", str(answers), str(tiny_model_dir)]) == 0
    assert json.loads(answers.read_text())["response"]["status_code"] == 200  # the engine lived on


def test_an_empty_input_answers_over_the_input_or_shared_custom_ids_are_refused(tmp_path, tiny_model_dir, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text("\n \n")
    assert main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), str(tiny_model_dir)]) == 2
    assert "no requests in the batch input file" in capsys.readouterr().err
    request = _line("x", "/v1/completions", COMPLETION) + "\n"
    source.write_text(request)
    for same in (source, tmp_path / "." / "in.jsonl"):
        assert main(["run-batch", "-i", str(source), "-o", str(same), str(tiny_model_dir)]) == 2
        assert "is the batch input file" in capsys.readouterr().err
    assert source.read_text() == request
    source.write_text(request + "not json\n" + request)
    assert main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), str(tiny_model_dir)]) == 2
    assert 'custom_id "x" is on lines 1 and 3; each request needs its own' in capsys.readouterr().err
