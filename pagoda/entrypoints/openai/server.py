"""Compatibility names for code written before the server was split into modules.

The app lives in `api_server.py` (vLLM's layout); import `build_app` / `run_server` from there.
"""

from pagoda.entrypoints.openai.api_server import (
    DEFAULT_MAX_BODY_BYTES,
    ServerArgs,
    build_app,
    run_server,
)

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ServerArgs", "build_app", "run_server"]
