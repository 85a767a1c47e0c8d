"""The shared evaluation data the gate's tests read (../shared/data, or $DRIFTGATE_DATA)."""

from __future__ import annotations

from pathlib import Path

import pytest

from evals import data


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The evaluation data folder; tests that read it skip where a checkout has none beside it."""
    try:
        return data.resolve_data_dir()
    except data.DataMissingError as exc:
        pytest.skip(f"shared evaluation data not present: {exc}")
