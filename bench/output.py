"""Where a benchmark's results go: JSON for the record, a PNG for the eye, folders made as needed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def save_result(result: Any, json_path: Path | None, plot_path: Path | None,
                plot: Callable[[Any, Path], None]) -> None:
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    if plot_path:
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        plot(result, plot_path)
