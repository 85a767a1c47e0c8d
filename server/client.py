"""What a client of an OpenAI-compatible server (ours or vLLM's) reads before sending work: the
models it serves. The gate's `--server` arm, `bench serve` and `chat --url` share it."""

from __future__ import annotations

import httpx


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer token a server started with `--api-key` wants (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_message(response: httpx.Response) -> str:
    """An error reply's own words: an OpenAI error body's message, else the start of the body."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    return message if isinstance(message, str) else response.text[:200]


def api_base(server_url: str) -> str:
    """The base an OpenAI-compatible server's routes hang off, from its root URL
    (http://host:8000 → http://host:8000/v1)."""
    return server_url.rstrip("/") + "/v1"


def model_cards(api_base: str, api_key: str | None = None, timeout: float = 10.0) -> list[dict]:
    """The server's model cards (`id`, and `root` / `max_model_len` where the server gives them),
    from `{api_base}/models` (`api_base` the one its other routes hang off, e.g.
    http://host:8000/v1). A ValueError says why when the list cannot be had."""
    url = api_base.rstrip("/") + "/models"
    try:
        response = httpx.get(url, headers=auth_headers(api_key), timeout=timeout)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {exc}") from None
    if response.status_code != 200:
        raise ValueError(f"{url} answered HTTP {response.status_code}: {error_message(response)}")
    try:
        cards = [card for card in response.json().get("data") or [] if isinstance(card, dict) and "id" in card]
    except (ValueError, AttributeError):
        raise ValueError(f"{url} did not answer with an OpenAI model list: {response.text[:200]!r}") from None
    if not cards:
        raise ValueError(f"{url} lists no model")
    return cards
