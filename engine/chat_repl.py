"""`driftgate chat MODEL`: a conversation in the terminal, as llama.cpp's `llama-cli` and `vllm chat` offer.

Each line typed is a user turn (a line ending in a backslash goes on to the next line); the answer
streams as it is generated, and the whole conversation is the next turn's prompt, rendered by the
model's chat template, so its earlier turns come from the prefix cache. A conversation that outgrows
the context loses its oldest turns (the system prompt stays). Ctrl-C stops an answer between two
engine steps, never inside one, so the engine stays whole and the request's KV blocks are freed;
what it had said stays in the conversation (a turn stopped before it said anything is dropped).
With `--url` the same conversation runs against a served model (server/chat_client.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.llm import LLM
from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams

COMMANDS_HELP = "/clear starts a new conversation, /exit (or Ctrl-D) leaves, Ctrl-C stops an answer; " \
                "end a line with \\ to go on to the next"
# what a turn leaves for its answer when max_tokens does not say (at most half the context)
DEFAULT_ANSWER_ROOM = 512


@dataclass(slots=True)
class Reply:
    text: str
    num_tokens: int
    finish_reason: str  # "stop", "length", or "interrupted" (Ctrl-C)
    first_token_s: float | None  # from the request to its first token (None: no token came)
    total_s: float
    dropped_turns: int  # earlier user turns (with their answers) left out to fit the context


class Conversation:
    """A system prompt and the turns so far (user and assistant messages, alternating, oldest first)."""

    def __init__(self, system: str | None):
        self.system = system
        self.turns: list[dict] = []
        self.num_asked = 0  # turns asked in this session: a seed moves on with each, as llama-cli's RNG does

    def clear(self) -> None:
        self.turns = []

    def messages(self, turns: list[dict]) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + turns

    def turn_seed(self, seed: int | None) -> int | None:
        """The seed of the next turn: a fixed --seed makes a session reproducible, not every turn alike."""
        return None if seed is None else (seed + self.num_asked) % 2**63

    def record(self, turns: list[dict], dropped: int, answer: str, finish: str) -> None:
        """Keep the turn just asked (with its answer, and without the `dropped` oldest pairs); a turn
        stopped before it said anything is left out, to be asked again."""
        self.num_asked += 1
        if finish != "interrupted" or answer:
            self.turns = [*turns[2 * dropped:], {"role": "assistant", "content": answer}]


class ChatSession(Conversation):
    """A conversation with a model held in process."""

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None,
                 lora: LoRARequest | None = None):
        super().__init__(system)
        self.llm = llm
        self.params = params
        self.lora = lora
        if lora is not None:
            llm.engine.add_lora(lora)
        max_len = llm.engine.max_model_len
        self.answer_room = min(params.max_tokens or DEFAULT_ANSWER_ROOM, max_len // 2)

    def ask(self, text: str, write: Callable[[str], None],
            interrupted: Callable[[], bool] = lambda: False) -> Reply:
        """Stream the answer to `text` through `write`, checking `interrupted` between steps.

        A message too long for the context even alone is a ValueError, and the conversation is
        left as it was."""
        turns = [*self.turns, {"role": "user", "content": text}]
        prompt, dropped = self._fit(turns)
        engine = self.llm.engine
        start = time.perf_counter()
        params = dataclasses.replace(self.params, seed=self.turn_seed(self.params.seed))
        request_id = engine.add_request(None, prompt, params, 0, None if self.lora is None else self.lora.lora_name)
        shown, first_token_s, finish, num_tokens = "", None, None, 0
        try:
            while finish is None:
                if interrupted():
                    engine.abort_request(request_id)
                    finish = "interrupted"
                    break
                for out in engine.step():
                    if out.request_id != request_id:
                        continue
                    completion = out.outputs[0]
                    if first_token_s is None and completion.token_ids:
                        first_token_s = time.perf_counter() - start
                    write(completion.text[len(shown):])
                    shown, num_tokens = completion.text, len(completion.token_ids)
                    if out.finished:
                        finish = completion.finish_reason
        except BaseException:  # a failed step: nothing of this request stays in the engine
            engine.abort_request(request_id)
            raise
        self.record(turns, dropped, shown, finish)
        return Reply(shown, num_tokens, finish, first_token_s, time.perf_counter() - start, dropped)

    def _fit(self, turns: list[dict]) -> tuple[list[int], int]:
        """The prompt for `turns` with room for the answer, and how many leading user turns (each
        with its answer) were left out to make it fit. Earlier turns leave to keep `answer_room`
        free; a message alone may take more, its answer then getting what is left."""
        max_len = self.llm.engine.max_model_len
        for dropped in range(len(turns) // 2 + 1):
            prompt = self.llm.apply_chat_template(self.messages(turns[2 * dropped:]))
            if len(prompt) <= max_len - self.answer_room:
                return prompt, dropped
        if len(prompt) < max_len:
            return prompt, dropped
        raise ValueError(f"this message takes {len(prompt)} tokens with the chat template, and the context holds "
                         f"{max_len}: send a shorter one")


def read_message(interactive: bool) -> str | None:
    """The next user turn: one line, or several joined where a line ends in a backslash (None at
    end of input). Bytes that are not UTF-8 read as U+FFFD. Ctrl-C while continuing a message
    drops that message and asks again; at an empty prompt it leaves (KeyboardInterrupt)."""
    lines: list[str] = []
    while True:
        try:
            line = input(("... " if lines else "> ") if interactive else "")
        except EOFError:
            if interactive:
                print()  # the shell's prompt on a line of its own
            return "\n".join(lines) if lines else None
        except KeyboardInterrupt:
            if not lines:
                raise
            print()
            lines = []
            continue
        line = line.encode("utf-8", "surrogateescape").decode("utf-8", "replace") if _has_surrogates(line) else line
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        return "\n".join([*lines, line])


def _has_surrogates(text: str) -> bool:
    """Whether stdin's decoding left undecodable bytes in `text` as lone surrogates."""
    return any("\ud800" <= ch <= "\udfff" for ch in text)


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    from engine.cli import add_engine_args

    parser.add_argument("model", nargs="?", help="model folder (leave out with --url)")
    parser.add_argument("--url", default=None,
                        help="talk to a served model instead: its OpenAI-compatible base URL (http://HOST:PORT[/v1])")
    parser.add_argument("--model-name", default=None, help="with --url: the served model (default: the first listed)")
    parser.add_argument("--api-key", default=os.environ.get("DRIFTGATE_API_KEY"),
                        help="with --url: bearer key (default: $DRIFTGATE_API_KEY)")
    parser.add_argument("--system", default=None, help="a system prompt for the conversation")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="cap on each answer (default: the model's generation config, else until it ends)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="default: the model's generation config, else 1.0")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stats", action="store_true",
                        help="after each answer, print its tokens, time to first token and decode speed (stderr)")
    add_engine_args(parser)


def run_chat(args: argparse.Namespace) -> int:
    """Bad flags, a model that cannot load or has no chat template, a server out of reach: one line,
    exit 2. A turn that fails says why and the session goes on; with piped input the exit is then 1."""
    chosen = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "seed": args.seed}
    chosen = {k: v for k, v in chosen.items() if v is not None}
    try:
        if (args.model is None) == (args.url is None):
            raise ValueError("name a model folder, or a server with --url (not both)")
        if args.url and (engine_flags := _engine_flags_given(args)):
            raise ValueError(f"{', '.join(engine_flags)} set an in-process engine; a --url server runs as it was "
                             "started (pass them to `driftgate serve`)")
        session = _remote_session(args, chosen) if args.url else _local_session(args, chosen)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        where = (f"{session.model} at {session.base}" if args.url
                 else f"{args.model} (context {session.llm.engine.max_model_len} tokens)")
        print(f"chatting with {where}; {COMMANDS_HELP}", file=sys.stderr)
    failed = False
    while True:
        try:
            message = read_message(interactive)
        except KeyboardInterrupt:  # Ctrl-C at the prompt leaves, as llama-cli does
            print(file=sys.stderr)
            return 0
        if message is None or message.strip() in ("/exit", "/quit"):
            return 1 if failed and not interactive else 0
        if message.strip() == "/clear":
            session.clear()
            continue
        if not message.strip():
            continue
        terminal = _Terminal()
        try:
            reply = session.ask(message, terminal) if args.url else _ask_with_ctrl_c(session, message, terminal)
        except ValueError as e:
            print("\n" if terminal.printed else "", end="", flush=True)  # the error on a line of its own
            print(f"error: {e}", file=sys.stderr)
            failed = True
            continue
        print(flush=True)
        if reply.dropped_turns:
            print(f"[left out the oldest {reply.dropped_turns} turn(s) to fit the context]", file=sys.stderr)
        if reply.finish_reason == "interrupted":
            print("[stopped]", file=sys.stderr)
        elif reply.finish_reason == "length":
            print("[cut at the token limit]", file=sys.stderr)
        if args.stats:
            print(_describe(reply), file=sys.stderr)


def _engine_flags_given(args: argparse.Namespace) -> list[str]:
    """The engine flags (engine.cli.add_engine_args) set to other than their defaults."""
    from engine.cli import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return ["--" + dest.replace("_", "-") for dest, default in vars(parser.parse_args([])).items()
            if getattr(args, dest) != default]


def _remote_session(args: argparse.Namespace, chosen: dict) -> Conversation:
    from server.chat_client import RemoteChat

    return RemoteChat(args.url, args.model_name, chosen, args.system, args.api_key)


def _local_session(args: argparse.Namespace, chosen: dict) -> ChatSession:
    from engine.cli import llm_from_args
    from engine.generation_config import sampling_defaults

    llm, lora = llm_from_args(args)
    if not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError(f"{args.model}'s tokenizer has no chat template: use `driftgate generate` for plain "
                         "text prompts")
    params = SamplingParams(**{"max_tokens": None, **sampling_defaults(args.model), **chosen})
    return ChatSession(llm, params, args.system, lora)


class _Terminal:
    """Prints an answer as it streams, and remembers whether it printed any of it."""

    def __init__(self) -> None:
        self.printed = False

    def __call__(self, text: str) -> None:
        self.printed = self.printed or bool(text)
        print(text, end="", flush=True)


def _ask_with_ctrl_c(session: ChatSession, message: str, write: Callable[[str], None]) -> Reply:
    """`session.ask`, Ctrl-C turned into a stop between steps."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        return session.ask(message, write, stop.is_set)
    finally:
        signal.signal(signal.SIGINT, previous)


def _describe(reply: Reply) -> str:
    """One line of timings for an answer, as llama-cli prints at its end."""
    if reply.first_token_s is None:
        return f"[{reply.num_tokens} tokens in {reply.total_s:.2f} s]"
    decode_s = reply.total_s - reply.first_token_s
    speed = f", {(reply.num_tokens - 1) / decode_s:.1f} tok/s after it" if reply.num_tokens > 1 and decode_s > 0 else ""
    return f"[{reply.num_tokens} tokens, first after {reply.first_token_s * 1000:.0f} ms{speed}]"
