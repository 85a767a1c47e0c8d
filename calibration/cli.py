"""``quantize MODEL_DIR --calib data.jsonl --scheme ... -o OUT_DIR`` (also ``driftgate quantize``).

A user error (bad data, missing model, unknown scheme, group size that does not fit, existing
output) is one line on stderr and exit code 2; nothing is left behind in OUT_DIR.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from calibration.options import (
    ALGORITHMS,
    GROUP_SIZES,
    KV_CACHE_DTYPES,
    KV_STRATEGIES,
    SCHEMES,
    QuantizeOptions,
)

EXIT_USAGE = 2
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(QuantizeOptions)}  # one source of defaults


def _group_size(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or an integer, got {value!r}") from None


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``quantize`` arguments to ``parser`` (shared with ``driftgate quantize``)."""
    parser.add_argument("model_dir", help="Hugging Face model folder (config.json, safetensors, tokenizer)")
    parser.add_argument("--calib", required=True, help="calibration JSONL: {text} | {messages} | {prompt, completion}")
    parser.add_argument("-o", "--output", required=True, help="checkpoint folder to write")
    parser.add_argument("--scheme", required=True, choices=SCHEMES,
                        help="weight scheme; 'none' writes KV-cache scales only (needs --kv-cache)")
    parser.add_argument("--algo", default=_DEFAULTS["algorithm"], choices=ALGORITHMS, help="weight algorithm")
    parser.add_argument("--smoothquant", type=float, default=None, metavar="ALPHA",
                        help="w8a8-int8: migrate activation outliers into the weights first (SmoothQuant, "
                             "strength α in (0, 1]; the paper uses 0.5)")
    parser.add_argument("--group-size", type=_group_size, default=None, metavar="{auto," +
                        ",".join(map(str, GROUP_SIZES)) + "}",
                        help="INT4 group size; auto takes the largest that divides every input size")
    parser.add_argument("--kv-cache", choices=KV_CACHE_DTYPES, default=None, help="calibrate FP8 KV-cache scales")
    parser.add_argument("--kv-scale-strategy", choices=KV_STRATEGIES, default=_DEFAULTS["kv_strategy"],
                        help="one KV scale per layer (default) or per KV head")
    parser.add_argument("--num-samples", type=int, default=_DEFAULTS["num_samples"])
    parser.add_argument("--num-heldout", type=int, default=_DEFAULTS["num_heldout"],
                        help="extra samples, not calibrated on, for the per-layer error report")
    parser.add_argument("--max-seq-len", type=int, default=_DEFAULTS["max_seq_len"],
                        help="truncate each sample to this many tokens")
    parser.add_argument("--ignore", nargs="+", default=list(_DEFAULTS["ignore"]),
                        help="Linears left unquantized: checkpoint names or re:regex (must include lm_head)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=_DEFAULTS["device"])
    parser.add_argument("--seed", type=int, default=_DEFAULTS["seed"], help="seed of the calibration-sample draw")
    parser.add_argument("--allow-few", action="store_true",
                        help="warn instead of failing when the file has fewer samples than --num-samples")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint folder (one a quantize run wrote, or an empty folder)")


def options_from_args(args: argparse.Namespace) -> QuantizeOptions:
    """The one place parsed arguments become a validated :class:`QuantizeOptions`."""
    return QuantizeOptions(
        model_dir=args.model_dir, calib_path=args.calib, output_dir=args.output, scheme=args.scheme,
        algorithm=args.algo, smoothquant=args.smoothquant, group_size=args.group_size, kv_cache=args.kv_cache,
        kv_strategy=args.kv_scale_strategy, num_samples=args.num_samples, num_heldout=args.num_heldout,
        max_seq_len=args.max_seq_len, ignore=tuple(args.ignore), device=args.device, seed=args.seed,
        allow_few=args.allow_few, overwrite=args.overwrite,
    )


def run_quantize(args: argparse.Namespace) -> int:
    """Run a parsed ``quantize`` command; returns the exit code (0, or 2 after a one-line error)."""
    from calibration.run import QuantizeError, quantize

    try:
        options = options_from_args(args)
    except ValueError as exc:  # a combination of arguments that cannot work
        print(f"quantize: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        output = quantize(options)
    except QuantizeError as exc:  # every input problem; anything else is a bug and keeps its traceback
        print(f"quantize: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # the checkpoint is published whole or not at all (quant.checkpoint.publish_folder)
        print(f"quantize: interrupted; a checkpoint is published whole, so {options.output_dir} is as it was "
              "unless the new one was already in place", file=sys.stderr)
        return 130
    print(f"wrote {output}")
    return 0


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the whole usage block on an error; a one-line message is easier to act on."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def main(argv: list[str] | None = None) -> int:
    parser = _OneLineErrorParser(prog="quantize", description=__doc__.split("\n")[0])
    add_quantize_args(parser)
    return run_quantize(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
