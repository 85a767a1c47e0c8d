"""`driftgate serve` as a real process: loads, serves, logs without prompt text, drains on SIGTERM."""

from __future__ import annotations

import json
import logging
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

SECRET_PROMPT = "The quick brown fox"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_healthy(proc: subprocess.Popen, url: str, **client: object) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "server did not become healthy"
        try:
            if httpx.get(url + "/health", timeout=1, **client).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def test_sigterm_drains_in_flight_stream_and_exits_0(tiny_model_dir: Path):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", str(tiny_model_dir), "--port", str(port), "--served-model-name", "tiny",
         "--drain-timeout", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(proc, url)
        body = {"prompt": SECRET_PROMPT, "max_tokens": 64, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                events.append(line[5:].strip())
                if len(events) == 2:
                    proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "length"  # the in-flight request ran to the end during the drain
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.communicate()[1]
    request_lines = [json.loads(line.split(": ", 1)[1]) for line in stderr.splitlines()
                     if "driftgate.server.access" in line]
    completions = [line for line in request_lines if line["route"] == "/v1/completions"]
    assert completions and completions[0]["status"] == 200 and completions[0]["output_tokens"] == 64
    assert completions[0]["ttft_s"] is not None
    assert SECRET_PROMPT not in stderr


def test_what_outlives_the_drain_timeout_answers_503_and_nothing_is_cut_off(tiny_model_dir: Path):
    """Past --drain-timeout the engine ends what still runs: a non-streaming request gets a 503
    body with Retry-After, a stream an error event and [DONE]; no handler is cancelled mid-response
    (no traceback), and the process exits 0."""
    import threading

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", str(tiny_model_dir), "--port", str(port), "--served-model-name", "tiny",
         "--drain-timeout", "0.5", "--max-num-seqs", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    body = {"prompt": SECRET_PROMPT, "max_tokens": 480, "ignore_eos": True, "n": 8}  # seconds of work at 2 seqs
    try:
        _wait_until_healthy(proc, url)
        answers: dict = {}
        plain = threading.Thread(target=lambda: answers.update(plain=httpx.post(url + "/v1/completions", json=body,
                                                                                timeout=60)))
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            events = [next(line for line in lines if line.startswith("data:"))]
            plain.start()  # queued behind the stream's samples
            time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            events += [line for line in lines if line.startswith("data:")]
        plain.join(60)
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["error"]["code"] == 503
        refused = answers["plain"]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == 503, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.communicate()[1]
    assert "Traceback" not in stderr and "Exception in ASGI application" not in stderr, stderr[-3000:]


def test_replicas_without_ray_exit_2_saying_what_to_install(tiny_model_dir: Path, monkeypatch, capsys):
    from server.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as if the cluster extra were not installed
    for flag in ("--replicas", "--data-parallel-size", "-dp"):  # vLLM's name for whole engines side by side
        assert main([str(tiny_model_dir), flag, "2"]) == 2
        assert "pip install driftgate[cluster]" in capsys.readouterr().err
    assert main([str(tiny_model_dir), "--replicas", "0"]) == 2
    assert main([str(tiny_model_dir), "--replica-lost-after", "5"]) == 2  # one engine: nothing to give up on
    assert "--replicas N" in capsys.readouterr().err
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            main([str(tiny_model_dir), "--replicas", "2", "--replica-lost-after", bad])
        assert "--replica-lost-after" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_cuda_exits_1_with_the_reason_and_no_traceback(tiny_model_dir: Path, caplog):
    from server.cli import main

    with caplog.at_level(logging.ERROR, logger="driftgate.server"):
        assert main([str(tiny_model_dir), "--device", "cuda", "--port", str(_free_port())]) == 1
    assert "sees no CUDA device" in caplog.text and "Traceback" not in caplog.text


def test_taken_port_or_bad_host_exit_2_before_anything_loads(tiny_model_dir: Path, monkeypatch, capsys):
    import server.cli
    from server.cli import main

    def must_not_load(args):
        raise AssertionError("the engine was built although the server could not listen")

    monkeypatch.setattr(server.cli, "build_engine", must_not_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([str(tiny_model_dir), "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err
    assert main([str(tiny_model_dir), "--host", "no-such-host.invalid"]) == 2
    assert "cannot listen on no-such-host.invalid:8000" in capsys.readouterr().err
    for bad in ("65536", "http"):
        with pytest.raises(SystemExit) as exit_info:
            main([str(tiny_model_dir), "--port", bad])
        assert exit_info.value.code == 2
        assert "argument --port" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--api-key", ""], "--api-key is empty"),
    (["--block-size", "0"], "block_size must be a power of two"),
    (["--max-lora-rank", "0"], "max_lora_rank must be at least 1"),
    (["--max-logprobs", "-5"], "max_logprobs must be -1"),
    (["--kv-scales", "dynamic"], "kv_scales='dynamic' only applies to an fp8"),
])
def test_bad_engine_flags_exit_2_before_the_port_is_bound(tiny_model_dir: Path, monkeypatch, capsys, flags, message):
    """A flag the engine refuses is a usage error, said before anything listens or loads (it was
    exit 1 from the loader thread, after binding); an empty --api-key would have served unguarded."""
    import server.cli
    from server.cli import main

    def must_not_listen(*args):
        raise AssertionError("the port was bound for flags that cannot serve")

    monkeypatch.setattr(server.cli, "_listen", must_not_listen)
    assert main([str(tiny_model_dir), *flags]) == 2
    assert message in capsys.readouterr().err


def test_unreadable_generation_config_exits_2_naming_the_file(tiny_model_dir: Path, tmp_path: Path, capsys):
    import shutil

    from server.cli import main

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text('{"top_p": 7}')
    assert main([str(folder), "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err
    assert "generation_config.json" in err and "top_p" in err


def test_chat_template_and_generation_config_flags(tmp_path: Path):
    from server.cli import _chat_template, add_serve_args

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert _chat_template(str(template)) == template.read_text()
    assert _chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="no such file"):
        _chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="line 1"):
        _chat_template("{% for m in messages %}")
    (tmp_path / "binary.jinja").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="cannot read"):
        _chat_template(str(tmp_path / "binary.jinja"))
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args(["m"]).generation_config == "auto"
    assert parser.parse_args(["m", "--override-generation-config", '{"temperature": 0.5}']).override_generation_config \
        == {"temperature": 0.5}
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--override-generation-config", "temperature=0.5"])


def test_generation_config_and_served_names_reach_the_config(tiny_model_dir: Path, tmp_path: Path, monkeypatch,
                                                              capsys):
    import shutil

    import server.cli
    from server.cli import main

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text('{"temperature": 0.25}')
    seen = []

    def record(app_engine, config):  # stop before serving: only the config matters here
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(server.cli, "build_app", record)
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"top_p": 0.5}')
    for flags, defaults in ((["--generation-config", "auto"], {"temperature": 0.25}),
                            (["--generation-config", "none"], {}), (["--generation-config", "vllm"], {}),
                            (["--generation-config", str(other)], {"top_p": 0.5}),
                            (["--override-generation-config", '{"top_k": 5, "max_new_tokens": 100}'],
                             {"temperature": 0.25, "top_k": 5, "max_tokens": 100})):
        with pytest.raises(SystemExit):
            main([str(folder), "--port", str(_free_port()), *flags])
        config = seen.pop()
        assert config.sampling_defaults == defaults and config.model_names == ("model",)  # the folder's name
    assert main([str(folder), "--port", "0", "--override-generation-config", '{"seed": 1}']) == 2
    assert "--override-generation-config sets seed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(folder), "--port", str(_free_port()), "--served-model-name", "smol", "gpt-4o-mini",
              "--reasoning-parser", "deepseek_r1"])
    config = seen.pop()
    assert config.model_names == ("smol", "gpt-4o-mini") and config.reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        main([str(folder), "--port", str(_free_port()), "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert seen.pop().default_chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(SystemExit):
        main([str(folder), "--port", str(_free_port()), "--enable-log-requests", "--max-log-len", "64"])
    config = seen.pop()
    assert config.log_requests and config.max_log_len == 64
    assert main([str(folder), "--port", "0", "--max-log-len", "-1"]) == 2
    assert main([str(folder), "--port", "0", "--default-chat-template-kwargs", '{"tools": []}']) == 2
    assert "default chat template kwargs may not set tools" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad_json:
        main([str(folder), "--port", "0", "--default-chat-template-kwargs", "enable_thinking=false"])
    assert bad_json.value.code == 2 and "default_chat_template_kwargs: not valid JSON" in capsys.readouterr().err


def test_hf_overrides_reach_the_engine_and_the_servers_classifier(tiny_model_dir: Path, monkeypatch, capsys):
    """--hf-overrides serves a causal LM as a classifier (the routes see its classes); bad JSON is exit 2."""
    import server.cli
    from server.cli import main

    seen = []

    def record(app_engine, config):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(server.cli, "build_app", record)
    overrides = '{"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["a", "b"]}'
    with pytest.raises(SystemExit):
        main([str(tiny_model_dir), "--port", str(_free_port()), "--hf-overrides", overrides])
    assert seen.pop().classifier.labels == ("a", "b")
    with pytest.raises(SystemExit) as exit_info:
        main([str(tiny_model_dir), "--hf-overrides", "{architectures"])
    assert exit_info.value.code == 2 and "hf_overrides: not valid JSON" in capsys.readouterr().err


def test_speculative_config_flag_is_parsed_and_checked_at_the_command_line(capsys):
    import argparse

    from server.cli import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args(["m"]).speculative_config is None
    spec = parser.parse_args(["m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert spec.speculative_config.num_speculative_tokens == 2
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["m", "--speculative-config", '{"method": "eagle", "model": "x"}'])
    assert exit_info.value.code == 2
    assert "unknown speculative config key(s): model" in capsys.readouterr().err


def test_vllm_spellings_of_flags_are_accepted():
    """A vLLM command line carries over: its prefix-caching switches and --enable-auto-tool-choice."""
    import argparse

    from server.cli import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args(["m"]).no_prefix_caching is False
    assert parser.parse_args(["m", "--enable-prefix-caching"]).no_prefix_caching is False
    assert parser.parse_args(["m", "--no-enable-prefix-caching"]).no_prefix_caching is True
    assert parser.parse_args(["m", "--no-prefix-caching"]).no_prefix_caching is True
    args = parser.parse_args(["m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.tool_call_parser == "hermes"


def test_max_logprobs_flag_reaches_the_engine_and_bounds_requests(tiny_model_dir):
    """--max-logprobs -1: a request may ask for every token's logprob; the default 20 is a 400
    naming the field past it (tests/server/test_openai_api.py)."""
    import argparse

    import httpx

    from server.app import build_app
    from server.cli import add_serve_args, build_engine
    from server.config import ServerConfig
    from tests.server.live import serve_in_thread

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    engine = build_engine(parser.parse_args([str(tiny_model_dir), "--max-logprobs", "-1"]))
    vocab = len(engine.tokenizer)
    assert engine.max_logprobs >= vocab
    engine.start()
    try:
        with serve_in_thread(build_app(engine, ServerConfig(served_model_name="m"))) as url:
            body = {"prompt": "The quick", "max_tokens": 1, "logprobs": vocab, "temperature": 0}
            out = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert out.status_code == 200 and len(out.json()["choices"][0]["logprobs"]["top_logprobs"][0]) > 20
            # -1: the whole vocabulary, as vLLM reads it (the last entry was cut by a [:-1] slice)
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": True,
                    "top_logprobs": -1, "prompt_logprobs": -1}
            out = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
            assert len(out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == vocab
            assert len(out["prompt_logprobs"][1]) == vocab
            # echo's and prompt_logprobs' counts meet in one prompt-logprob request: -1 is the wider
            body = {"prompt": "The quick brown", "max_tokens": 1, "echo": True, "logprobs": 3, "prompt_logprobs": -1}
            out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
            assert len(out["prompt_logprobs"][1]) == vocab
            body = {**body, "logprobs": -1, "prompt_logprobs": 3}
            out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
            assert len(out["logprobs"]["top_logprobs"][1]) > 20 and len(out["prompt_logprobs"][1]) == 4
    finally:
        engine.shutdown()


def _self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def test_https_with_client_certificates(tiny_model_dir: Path, tmp_path: Path):
    """--ssl-certfile/--ssl-keyfile serve HTTPS, and with --ssl-ca-certs only to clients presenting a
    certificate those CAs signed (here the self-signed one, its own CA): such a client completes; one
    without a certificate, one that does not trust the server's, and plain HTTP get no answer."""
    cert, key = _self_signed_certificate(tmp_path)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", str(tiny_model_dir), "--port", str(port), "--served-model-name", "tiny",
         "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-ca-certs", str(cert)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    url = f"https://127.0.0.1:{port}"
    try:
        client = ssl.create_default_context(cafile=str(cert))
        client.load_cert_chain(cert, key)
        _wait_until_healthy(proc, url, verify=client)
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 3}
        reply = httpx.post(url + "/v1/completions", json=body, verify=client, timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx.TransportError):  # trusts the server but shows no certificate
            httpx.get(url + "/health", verify=ssl.create_default_context(cafile=str(cert)), timeout=5)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust it refuses it
            httpx.get(url + "/health", timeout=5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_unloadable_tls_files_exit_2_before_anything_loads(tiny_model_dir: Path, tmp_path: Path, capsys):
    from server.cli import main

    cert, key = _self_signed_certificate(tmp_path)
    for flags, message in ((["--ssl-certfile", str(cert)], "both --ssl-certfile and --ssl-keyfile"),
                           (["--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "none.pem")],
                            "cannot load the TLS certificate"),
                           (["--ssl-certfile", str(key), "--ssl-keyfile", str(key)], "cannot load the TLS certificate")):
        assert main([str(tiny_model_dir), "--port", "0", *flags]) == 2
        assert message in capsys.readouterr().err


def test_require_gate_refuses_numerics_the_gate_did_not_judge(tiny_model_dir: Path, tmp_path: Path, capsys):
    """--require-gate: the verdict must pass for these weights, activation dtype and KV cache;
    serving a checkpoint gated in fp32 with the model's own KV cache with fp8_e5m2, or in bf16
    (what `auto` is on a GPU), is exit 2, naming both."""
    import shutil

    from engine.config import serving_setting
    from evals import verdict
    from server.cli import main

    model = tmp_path / "gated"
    shutil.copytree(tiny_model_dir, model)
    assert main([str(model), "--port", "0", "--require-gate"]) == 2
    assert "no verdict.json" in capsys.readouterr().err
    verdict.write_verdict(model, passed=True, policy={}, metrics={}, baseline_hashes={},
                          serving=serving_setting(str(model), "auto", "cpu", "auto", "checkpoint"))
    assert main([str(model), "--port", "0", "--require-gate", "--device", "cpu", "--kv-cache-dtype", "fp8_e5m2"]) == 2
    assert ("judged this checkpoint with float32 activations and KV cache auto, not float32 activations and "
            "KV cache fp8_e5m2") in capsys.readouterr().err
    assert main([str(model), "--port", "0", "--require-gate", "--device", "cpu", "--dtype", "bfloat16"]) == 2
    assert "not bfloat16 activations and KV cache auto; gate it so (driftgate gate ... --dtype bfloat16" in \
        capsys.readouterr().err
    # nor another chat template or config than the folder's, which the verdict binds
    for flags in (["--chat-template", "{{ messages[0].content }}"], ["--hf-overrides", '{"rope_theta": 5000}'],
                  ["--tokenizer", str(tiny_model_dir)]):
        assert main([str(model), "--port", "0", "--require-gate", *flags]) == 2
        assert f"--require-gate: {flags[0]} would serve another model than the gate judged" in capsys.readouterr().err
    (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text().replace("{", "{ ", 1))
    assert main([str(model), "--port", "0", "--require-gate"]) == 2
    assert "sha256 mismatch: tokenizer_config.json" in capsys.readouterr().err


def test_require_gate_warns_of_unjudged_contexts_and_narrow_passes(tiny_model_dir: Path, tmp_path: Path):
    """A gated checkpoint starts; when it takes longer contexts than its verdict's policy judged
    (drift, an fp8 KV cache's above all, can grow with the context), the log says so, and it names
    the checks the verdict passed within their sampling uncertainty."""
    import shutil

    from engine.config import serving_setting
    from evals import verdict

    model = tmp_path / "gated"
    shutil.copytree(tiny_model_dir, model)
    checks = [{"name": "tier0.kl_growth", "status": "pass", "value": 1.9, "threshold": 2.0, "interval": [1.5, 2.5],
               "marginal": True},
              {"name": "tier0.kl_mean", "status": "pass", "value": 0.01, "threshold": 0.05, "interval": [0.008, 0.012],
               "marginal": False}]
    verdict.write_verdict(model, passed=True, policy={"engine": {"max_model_len": 64}}, metrics={"checks": checks},
                          baseline_hashes={}, serving=serving_setting(str(model), "auto", "cpu", "auto", "checkpoint"))
    assert verdict.marginal_checks(model) == ["tier0.kl_growth 1.9 against 2 (interval [1.5, 2.5])"]
    logs = []
    for max_model_len in ("64", "128"):
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", str(model), "--port", str(port), "--device", "cpu",
                                 "--require-gate", "--max-model-len", max_model_len],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_until_healthy(proc, f"http://127.0.0.1:{port}")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        logs.append(proc.communicate()[1])
    assert "gate judged" not in logs[0]
    assert "the gate judged contexts of up to 64 tokens; this server takes up to 128" in logs[1]
    assert all("passed this checkpoint narrowly: tier0.kl_growth 1.9 against 2 (interval [1.5, 2.5]);" in log
               and "kl_mean" not in log for log in logs)


def test_require_gate_checks_each_adapter_served(tiny_model_dir: Path, tmp_path: Path):
    """With --lora-modules every adapter needs its own passing verdict over this checkpoint (gate
    --lora writes it into the adapter's folder); adapters loaded at run time would bypass the
    gate, so --require-gate refuses --allow-runtime-lora-updating."""
    import argparse
    import shutil

    pytest.importorskip("peft")
    from engine.config import serving_setting
    from evals import verdict
    from server.cli import add_serve_args, server_config
    from tests.helpers import write_lora_adapter

    model = tmp_path / "gated"
    shutil.copytree(tiny_model_dir, model)
    adapter = write_lora_adapter(model, tmp_path / "sql", ["q_proj"], seed=1)
    auto = serving_setting(str(model), "auto", "cpu", "auto", "checkpoint")
    verdict.write_verdict(model, passed=True, policy={}, metrics={}, baseline_hashes={}, serving=auto)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)

    def refusal(*flags: str) -> str:
        with pytest.raises(ValueError) as info:
            server_config(parser.parse_args([str(model), "--require-gate", *flags]))
        return str(info.value)

    assert server_config(parser.parse_args([str(model), "--require-gate"])).model_names
    assert "adapter sql: " in refusal("--lora-modules", f"sql={adapter}")
    verdict.write_verdict(adapter, passed=True, policy={}, metrics={}, baseline_hashes={}, serving=auto,
                          base_hashes=verdict.weight_hashes(model))
    assert server_config(parser.parse_args([str(model), "--require-gate", "--lora-modules", f"sql={adapter}"]))
    assert "bypass the gate" in refusal("--enable-lora", "--allow-runtime-lora-updating")


def test_gpu_memory_utilization_reaches_the_engine_and_is_said_to_do_nothing_on_a_cpu(caplog):
    import argparse

    from server.cli import _gpu_memory_utilization, add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert _gpu_memory_utilization(parser.parse_args(["m"])) == {}
    with caplog.at_level(logging.WARNING, logger="driftgate.server"):
        chosen = _gpu_memory_utilization(parser.parse_args(["m", "--device", "cpu", "--gpu-memory-utilization", "0.5"]))
    assert chosen == {"gpu_memory_utilization": 0.5}
    assert "--gpu-memory-utilization applies to CUDA devices" in caplog.text


def test_vllm_flags_run_where_they_mean_what_happens_here_and_say_what_to_do_where_not(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch, capsys):
    """A vLLM command line's -tp 1, --trust-remote-code, --enable-chunked-prefill, --disable-log-requests
    and its logging and docs flags start the server; parallelism and load-time quantization are exit 2
    saying what to use instead."""
    import server.cli
    from server.cli import main

    started = []

    def record(app_engine, config):
        started.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(server.cli, "build_app", record)
    with pytest.raises(SystemExit):
        main([str(tiny_model_dir), "--port", str(_free_port()), "-tp", "1", "--pipeline-parallel-size", "1",
              "--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests",
              "--enable-prompt-tokens-details", "--disable-fastapi-docs", "--disable-log-stats",
              "--uvicorn-log-level", "warning", "--root-path", "/llm"])
    assert len(started) == 1 and not started[0].log_requests and started[0].log_stats_interval_s is None
    assert main([str(tiny_model_dir), "--port", "0", "--tensor-parallel-size", "2"]) == 2
    assert "--tensor-parallel-size 2: a model runs whole on one device here" in capsys.readouterr().err
    assert main([str(tiny_model_dir), "--port", "0", "-pp", "2"]) == 2
    assert "--replicas N" in capsys.readouterr().err
    assert main([str(tiny_model_dir), "--port", "0", "--quantization", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "does not quantize at load" in err and "is unquantized" in err and "driftgate quantize" in err

    import argparse
    import json
    import shutil

    quantized = tmp_path / "quantized"  # what the check reads: the checkpoint's own method
    shutil.copytree(tiny_model_dir, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (quantized / "config.json").write_text(json.dumps(config))
    parser = argparse.ArgumentParser()
    server.cli.add_serve_args(parser)
    server.cli._check_vllm_flags(parser.parse_args([str(quantized), "-q", "compressed-tensors"]))
    with pytest.raises(ValueError, match="is a compressed-tensors checkpoint"):
        server.cli._check_vllm_flags(parser.parse_args([str(quantized), "-q", "fp8"]))



def test_tokenizer_flag_serves_another_folders_tokenizer_and_chat_template(tiny_model_dir: Path, tmp_path: Path,
                                                                          capsys):
    """--tokenizer DIR (vLLM's): the engine reads its tokenizer, chat template included, from DIR."""
    import argparse
    import json
    import shutil

    from server.cli import add_serve_args, build_engine, main

    other = tmp_path / "tokenizer"
    other.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", other)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "OTHER {{ messages[0]['content'] }}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    engine = build_engine(parser.parse_args([str(tiny_model_dir), "--device", "cpu", "--tokenizer", str(other)]))
    try:
        assert engine.tokenizer.chat_template == "OTHER {{ messages[0]['content'] }}"
    finally:
        engine.shutdown()
    assert main([str(tiny_model_dir), "--port", "0", "--tokenizer", str(tmp_path / "missing")]) == 2
    assert "tokenizer folder not found" in capsys.readouterr().err
