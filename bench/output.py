"""Where a benchmark's results go: JSON for the record, a PNG for the eye, folders made as needed."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any


def check_result_paths(args: Any) -> None:
    """ValueError now, before the benchmark runs, if its --result-json or --plot could not be written
    after it (a folder given, or a path under a file): minutes of measurement would be lost."""
    from engine.output_paths import check_output_path

    for flag in ("result_json", "plot"):
        if (path := getattr(args, flag, None)) is not None:
            check_output_path(Path(path), folder=False)


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over repeated runs of one measurement (each run a dict of numbers)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def save_result(result: Any, json_path: Path | None, plot_path: Path | None,
                plot: Callable[[Any, Path], None]) -> None:
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    if plot_path:
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        plot(result, plot_path)


def plot_kernels(rows: list[dict], x: str, y: Callable[[dict], float], path: Path, *, xlabel: str, ylabel: str,
                 title: str, log_y: bool = False) -> None:
    """One line per `kernel` in rows: y(row) against row[x] (log2 x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        points = [(r[x], y(r)) for r in rows if r["kernel"] == kernel]
        ax.plot(*zip(*points, strict=True), marker="o", label=kernel)
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
