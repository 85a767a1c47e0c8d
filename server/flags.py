"""What `driftgate serve` takes beyond plain argparse, as vLLM's serve does: flags read from a YAML
file (`--config`) and integers written with a size suffix (`--max-model-len 32K`).

A deployment keeps its flags in a file (a Kubernetes ConfigMap, a checked-in config) and overrides
one or two on the command line, so the file's values become the parser's defaults: what the
command line says wins, then the file, then the built-in defaults.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 (a count that 0 would only fail later, after loading)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a finite duration above 0 seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def human_int(text: str) -> int:
    """argparse type: a positive integer, or one with a size suffix: k/m/g/t are powers of 1000 and
    take a fraction (25.6k = 25600), K/M/G/T powers of 1024 and take a whole number (32K = 32768)."""
    value = _size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text.strip()}")
    return value


def _size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not an integer or a size like 32K or 1.5k: {text!r}")
    number, suffix = match.groups()
    if suffix in _BINARY:
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: {suffix} counts in 1024s and takes a whole number "
                                             f"(a decimal size is lower-case, e.g. {number}{suffix.lower()})")
        return int(number) * _BINARY[suffix]
    if "." not in number:
        return int(number) * _DECIMAL.get(suffix, 1)
    value = float(number) * _DECIMAL.get(suffix, 1)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def config_file_path(argv: Sequence[str]) -> str | None:
    """The FILE of `--config FILE` or `--config=FILE` in argv, if any."""
    for i, token in enumerate(argv):
        if token == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--config="):
            return token.partition("=")[2]
    return None


def apply_config_file(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Make the values of argv's `--config FILE` (YAML: long flag names, without the dashes, to
    values; `model` for the positional) the parser's defaults. Each is checked as the command line's
    would be; a bad file or value is a parser error (exit 2) naming the file and the key."""
    path = config_file_path(argv)
    if path is None:
        return

    def fail(message: str):
        parser.error(f"--config {path}: {message}")

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        fail(exc.strerror or str(exc))
    except UnicodeDecodeError:
        fail("not UTF-8 text (save it as UTF-8)")
    except yaml.YAMLError as exc:
        fail(f"not valid YAML ({exc})")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        fail(f"should map flag names to values, not be a {type(raw).__name__}")
    actions = {option[2:]: action for action in parser._actions for option in action.option_strings
               if option.startswith("--") and action.dest not in ("help", "config")}
    actions.update({action.dest: action for action in parser._actions if not action.option_strings})
    defaults: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("_", "-")
        action = actions.get(name) or actions.get(str(key))
        if action is None:
            close = difflib.get_close_matches(name, list(actions), n=1)
            fail(f"unknown option {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        defaults[action.dest] = _default(action, name, value, fail)
    parser.set_defaults(**defaults)


def _default(action: argparse.Action, name: str, value: Any, fail) -> Any:
    """A config value as the parser's default for `action`: checked with the action's type and
    choices; single values stay text where argparse converts defaults itself (it does for strings)."""
    if action.nargs == 0:  # a switch (store_true / store_false)
        if not isinstance(value, bool):
            fail(f"{name}: true or false, not {value!r}")
        return action.const if value else not action.const
    many = action.nargs in ("+", "*")
    if isinstance(value, list) and not many:
        fail(f"{name}: one value, not a list")
    texts = [_text(item) for item in (value if isinstance(value, list) else [value])]
    if many and not texts and action.nargs == "+":
        fail(f"{name}: at least one value")
    converted = []
    for text in texts:
        try:
            item = action.type(text) if action.type is not None else text
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            fail(f"{name}: {exc}")
        if action.choices is not None and item not in action.choices:
            fail(f"{name}: {text!r} is not one of {', '.join(map(str, action.choices))}")
        converted.append(item)
    return converted if many else texts[0]


def _text(value: Any) -> str:
    """A YAML value as the command line would have spelled it (a mapping or list as JSON)."""
    if isinstance(value, dict | list):
        return json.dumps(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
