"""The server tests' checkpoint and log-folder fixtures, for the replica tests' real servers."""

from tests.server.conftest import llama_checkpoint, server_logs  # noqa: F401
