"""The live-server fixtures of the server tests, for the end-to-end benchmark run."""

from tests.server.conftest import engine  # noqa: F401  (a fixture, used by name)
