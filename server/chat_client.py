"""`driftgate chat --url`: the terminal conversation of engine/chat_repl.py with a served model (ours,
vLLM's, any OpenAI-compatible server), streamed from its `/v1/chat/completions`."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

from engine.chat_repl import Conversation, Reply
from server.client import auth_headers, model_cards


class RemoteChat(Conversation):
    """A conversation with a served model, through its streamed `/v1/chat/completions`.

    The server says when a conversation no longer fits (OpenAI's and vLLM's "maximum context
    length" 400); its oldest turns are then left out, as in process. Ctrl-C closes the stream,
    which a server frees the request's blocks on."""

    def __init__(self, url: str, model: str | None, fields: dict, system: str | None = None,
                 api_key: str | None = None):
        super().__init__(system)
        self.base = url.rstrip("/") if url.rstrip("/").endswith("/v1") else url.rstrip("/") + "/v1"
        self.headers = {"Content-Type": "application/json", **auth_headers(api_key)}
        self.model = self._served_model(model, api_key)
        self.fields = fields  # sampling fields the user set; the server's defaults for the rest

    def _served_model(self, model: str | None, api_key: str | None) -> str:
        """`model` if the server lists it, else (None) the first it lists; ValueError otherwise."""
        listed = [card["id"] for card in model_cards(self.base, api_key)]
        if model is not None and model not in listed:
            raise ValueError(f"{self.base} serves {', '.join(map(str, listed))}, not {model!r}")
        return model or listed[0]

    def _open(self, method: str, path: str, body: dict | None = None):
        """The response, or a ValueError with the server's own message (or why it could not be reached)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method, headers=self.headers)
        try:
            return urllib.request.urlopen(request, timeout=600)
        except urllib.error.HTTPError as e:
            try:
                message = json.load(e).get("error", {}).get("message") or e.reason
            except ValueError:
                message = e.reason
            raise ServerRefused(e.code, f"{self.base}{path} answered {e.code}: {message}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ValueError(f"cannot reach {self.base}: {getattr(e, 'reason', e)}") from None

    def ask(self, text: str, write: Callable[[str], None]) -> Reply:
        """Stream the answer to `text` through `write`. Ctrl-C (before or during the answer) closes
        the stream and keeps the session; a refusal or a stream cut short is a ValueError, and the
        conversation is left as it was."""
        turns = [*self.turns, {"role": "user", "content": text}]
        fields = {**self.fields, **({"seed": self.turn_seed(self.fields["seed"])} if "seed" in self.fields else {})}
        start = time.perf_counter()
        shown, first_token_s, finish, num_tokens, chunks, dropped = "", None, None, None, 0, 0
        try:
            response, dropped = self._open_fitting(turns, fields)
            with response:
                for chunk in _server_sent_events(response):
                    if chunk.get("usage"):
                        num_tokens = chunk["usage"].get("completion_tokens")
                    for choice in chunk.get("choices") or ():
                        if delta := (choice.get("delta") or {}).get("content"):
                            first_token_s = first_token_s or time.perf_counter() - start
                            shown += delta
                            chunks += 1
                            write(delta)
                        finish = choice.get("finish_reason") or finish
        except KeyboardInterrupt:  # closing the stream (leaving `with`) ends the request on the server
            finish = "interrupted"
        except (http.client.HTTPException, OSError) as e:
            raise ValueError(f"the connection to {self.base} broke mid-answer ({e!r})") from None
        if finish is None:
            raise ValueError(f"{self.base} ended the answer without finishing it (no finish_reason)")
        self.record(turns, dropped, shown, finish)
        return Reply(shown, chunks if num_tokens is None else num_tokens, finish, first_token_s,
                     time.perf_counter() - start, dropped)

    def _open_fitting(self, turns: list[dict], fields: dict):
        """The streamed response to `turns`, and how many leading user turns (each with its answer)
        were left out after the server said the conversation no longer fits its context."""
        dropped = 0
        while True:
            body = {"model": self.model, "messages": self.messages(turns[2 * dropped:]), "stream": True,
                    "stream_options": {"include_usage": True}, **fields}
            try:
                return self._open("POST", "/chat/completions", body), dropped
            except ServerRefused as e:
                too_long = e.status == 400 and "maximum context length" in str(e).lower()
                if not too_long or 2 * dropped + 1 >= len(turns):
                    raise ValueError(str(e)) from None
                dropped += 1


class ServerRefused(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _server_sent_events(response) -> Iterator[dict]:
    """The JSON chunks of an OpenAI stream, up to `data: [DONE]`; an error event, or a stream that
    ends without [DONE] (the server gone), is a ValueError."""
    for raw in response:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            raise ValueError(f"the server failed mid-answer: {error.get('message') if isinstance(error, dict) else error}")
        yield chunk
    raise ValueError("the stream ended before the server said [DONE] (the server stopped?)")
