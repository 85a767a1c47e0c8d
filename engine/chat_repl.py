"""`driftgate chat MODEL`: a conversation in the terminal, as llama.cpp's `llama-cli` and `vllm chat` offer.

Each line typed is a user turn (a line ending in a backslash goes on to the next line); the answer
streams as it is generated, and the whole conversation is the next turn's prompt, rendered by the
model's chat template, so its earlier turns come from the prefix cache. A conversation that outgrows
the context loses its oldest turns (the system prompt stays). Ctrl-C stops an answer between two
engine steps, never inside one, so the engine stays whole and the request's KV blocks are freed;
what it had said stays in the conversation.
"""

from __future__ import annotations

import argparse
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


class ChatSession:
    """One conversation with a model held in process: its turns, and how each is asked."""

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None,
                 lora: LoRARequest | None = None):
        self.llm = llm
        self.params = params
        self.system = system
        self.lora = lora
        if lora is not None:
            llm.engine.add_lora(lora)
        self.turns: list[dict] = []  # user and assistant messages, alternating, oldest first
        max_len = llm.engine.max_model_len
        self.answer_room = min(params.max_tokens or DEFAULT_ANSWER_ROOM, max_len // 2)

    def clear(self) -> None:
        self.turns = []

    def ask(self, text: str, write: Callable[[str], None],
            interrupted: Callable[[], bool] = lambda: False) -> Reply:
        """Stream the answer to `text` through `write`, checking `interrupted` between steps.

        A message too long for the context even alone is a ValueError, and the conversation is
        left as it was."""
        turns = [*self.turns, {"role": "user", "content": text}]
        prompt, dropped = self._fit(turns)
        engine = self.llm.engine
        start = time.perf_counter()
        request_id = engine.add_request(None, prompt, self.params, 0, None if self.lora is None else self.lora.lora_name)
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
        self.turns = [*turns[2 * dropped:], {"role": "assistant", "content": shown}]
        return Reply(shown, num_tokens, finish, first_token_s, time.perf_counter() - start, dropped)

    def _fit(self, turns: list[dict]) -> tuple[list[int], int]:
        """The prompt for `turns` with room for the answer, and how many leading user turns (each
        with its answer) were left out to make it fit."""
        limit = self.llm.engine.max_model_len - self.answer_room
        system = [{"role": "system", "content": self.system}] if self.system else []
        for dropped in range(len(turns) // 2 + 1):
            prompt = self.llm.apply_chat_template(system + turns[2 * dropped:])
            if len(prompt) <= limit:
                return prompt, dropped
        raise ValueError(f"this message takes {len(prompt)} tokens with the chat template, and the context holds "
                         f"{self.llm.engine.max_model_len} with {self.answer_room} kept for the answer: "
                         "send a shorter one")


def read_message(interactive: bool) -> str | None:
    """The next user turn: one line, or several joined where a line ends in a backslash (None at
    end of input)."""
    lines: list[str] = []
    while True:
        try:
            line = input(("... " if lines else "> ") if interactive else "")
        except EOFError:
            return "\n".join(lines) if lines else None
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        return "\n".join([*lines, line])


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    from engine.cli import add_engine_args

    parser.add_argument("model", help="model folder")
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
    """Bad flags, a model that cannot load or has no chat template: one line, exit 2."""
    from engine.cli import llm_from_args
    from engine.generation_config import sampling_defaults

    try:
        llm, lora = llm_from_args(args)
        if not getattr(llm.tokenizer, "chat_template", None):
            raise ValueError(f"{args.model}'s tokenizer has no chat template: use `driftgate generate` for plain "
                             "text prompts")
        chosen = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                  "top_k": args.top_k, "seed": args.seed}
        params = SamplingParams(**{"max_tokens": None, **sampling_defaults(args.model),
                                   **{k: v for k, v in chosen.items() if v is not None}})
        session = ChatSession(llm, params, args.system, lora)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(f"chatting with {args.model} (context {llm.engine.max_model_len} tokens); {COMMANDS_HELP}",
              file=sys.stderr)
    while True:
        try:
            message = read_message(interactive)
        except KeyboardInterrupt:  # Ctrl-C at the prompt leaves, as llama-cli does
            print(file=sys.stderr)
            return 0
        if message is None or message.strip() in ("/exit", "/quit"):
            return 0
        if message.strip() == "/clear":
            session.clear()
            continue
        if not message.strip():
            continue
        try:
            reply = _ask_with_ctrl_c(session, message)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
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


def _print_now(text: str) -> None:
    print(text, end="", flush=True)


def _ask_with_ctrl_c(session: ChatSession, message: str, write: Callable[[str], None] = _print_now) -> Reply:
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
