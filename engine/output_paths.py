"""Checks that an output can be written, made before the work that produces it.

Quantizing, answering a batch file and gating take minutes; a path that cannot be written (a
file where a folder should be, or the other way round, or no permission) should stop them at
the start with its reason, not end them with a traceback and the work lost.
"""

from __future__ import annotations

import os
from pathlib import Path


def check_output_path(path: Path, *, folder: bool) -> None:
    """ValueError unless `path` can later be created (or replaced) as a folder (`folder`) or a file."""
    if path.exists():
        if folder and not path.is_dir():
            raise ValueError(f"{path} is a file, not a folder")
        if not folder and path.is_dir():
            raise ValueError(f"{path} is a folder; give a file name")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"cannot write {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {path}: no permission to write in {parent}")
