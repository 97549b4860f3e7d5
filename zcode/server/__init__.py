"""The OpenAI-compatible HTTP server: `zcode serve`, or `run_server()` from Python."""

from zcode.server.launch import run_server

__all__ = ["run_server"]
