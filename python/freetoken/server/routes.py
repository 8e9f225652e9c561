"""The server's application: the OpenAI and llama.cpp endpoints (app.py) and Anthropic's
Messages endpoint (anthropic.py) behind the error and API key middlewares."""

from __future__ import annotations

from aiohttp import web

from freetoken.server import anthropic
from freetoken.server.app import (
    MAX_BODY,
    STATE,
    ServerState,
    auth_middleware,
    chat_completions,
    completions,
    detokenize,
    errors_middleware,
    health,
    metrics,
    models,
    tokenize,
)

__all__ = ["create_app"]


def create_app(state: ServerState) -> web.Application:
    """The application with every route (each OpenAI ``/v1`` route also without the prefix)."""
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware], client_max_size=MAX_BODY
    )
    app[STATE] = state
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/chat/completions", chat_completions)
        app.router.add_post(f"{prefix}/completions", completions)
        app.router.add_get(f"{prefix}/models", models)
        app.router.add_get(f"{prefix}/health", health)
    app.router.add_post("/v1/messages", anthropic.messages)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)
    return app
