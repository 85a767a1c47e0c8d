"""sha256 of a file's bytes: what ties a verdict, a calibration report or an import to the exact files it read."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path, chunk_size: int = 1 << 20) -> str:
    """Hex sha256 of the file at `path`, read in chunks (checkpoints and GGUFs run to gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
