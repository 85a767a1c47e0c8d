"""`driftgate lm-eval ...`: lm-evaluation-harness's own command line, with `--model driftgate`.

lm-eval looks models up in a registry that a package installed beside it cannot join from outside
(it has no plugin entry points), so `lm_eval --model driftgate` would not find ours. This command
imports the adapter (evals/lm_eval_model.py), then hands every argument after it to lm-eval's CLI:
`driftgate lm-eval --model driftgate --model_args pretrained=DIR --tasks piqa` runs as `lm_eval` would.
"""

from __future__ import annotations

import argparse
import sys


def add_lm_eval_args(parser: argparse.ArgumentParser) -> None:
    """Nothing of ours: engine.cli.main passes what follows `lm-eval` on unparsed (`passthrough`)."""


def run_lm_eval(args: argparse.Namespace) -> int:
    from lm_eval.__main__ import cli_evaluate

    import evals.lm_eval_model  # noqa: F401  (registers the "driftgate" model)

    sys.argv = ["driftgate lm-eval", *args.passthrough]
    try:
        cli_evaluate()
    except SystemExit as exit_:  # lm-eval's argparse and its own exits (--help, bad arguments)
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0
