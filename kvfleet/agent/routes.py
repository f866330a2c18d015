"""The agent's route table: every engine route a client may reach, and how the agent treats it.

A route that generates tokens passes the request gate, tenant isolation (the server-side
``cache_salt``) and token admission; a read-only route is forwarded as is; anything else is 404 at
the agent (the engine's administrative routes, routes whose body the agent cannot salt, such as
multipart audio uploads). A trailing slash names the same route (the engine would answer 307 and the
agent never follows redirects). ``tests/agent/test_vllm_integration.py`` reads the pinned vLLM's
OpenAPI document and fails when one of its token-generating routes is missing here;
``tests/agent/test_routes.py`` holds the table to the route lists of later vLLM releases (0.33.0, 0.34.0),
read from their sdists: every route that runs the model is a generation route here or refused with its
reason, every administrative route is 404 (``/fault_tolerance/*``, renamed ``/v1/fault_tolerance/*`` in 0.34.0,
and ``/checkpoint/*`` among them: nothing under ``/v1`` is forwarded by prefix, only the paths named here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, kw_only=True)
class Route:
    methods: frozenset[str]
    generates: bool  # gate, tenant isolation and admission


_POST = frozenset({"POST"})
_GET = frozenset({"GET", "HEAD"})

GENERATE: Final = Route(methods=_POST, generates=True)
READ: Final = Route(methods=_GET, generates=False)
UTILITY: Final = Route(methods=_POST, generates=False)

ROUTES: Final[dict[str, Route]] = {
    # Token generation (vLLM 0.32's OpenAI, Anthropic, Cohere, SageMaker and token-in-token-out APIs).
    # /generative_scoring and /v1/decisions name no generation limit (they run one-token reads, one per item or
    # question): admission charges them as any request without one, the prompt plus the rest of the context window.
    "/v1/completions": GENERATE,
    "/v1/chat/completions": GENERATE,
    "/v1/chat/completions/batch": GENERATE,
    "/v1/responses": GENERATE,
    "/v1/messages": GENERATE,
    "/invocations": GENERATE,
    "/inference/v1/generate": GENERATE,
    "/generative_scoring": GENERATE,
    # vLLM 0.33.0 on: one read of `input` per question (max_tokens 1, the reads sharing the input's cached prefix),
    # answered with probabilities and the cached-token count; its request takes cache_salt, forbids unknown fields.
    "/v1/decisions": GENERATE,
    # Read-only: no tokens generated, nothing cached per tenant.
    "/v1/models": READ,
    "/version": READ,
    "/tokenize": UTILITY,
    "/detokenize": UTILITY,
    "/v1/messages/count_tokens": UTILITY,
}

# Engine routes that generate tokens and that the agent refuses (404), with the reason: the test on the
# engine's OpenAPI document, and the one on later releases' route lists, accept a generating route only when it
# is in ROUTES or here.
REFUSED: Final[dict[str, str]] = {
    "/v1/audio/transcriptions": "a multipart upload: the agent cannot set its cache_salt",
    "/v1/audio/translations": "a multipart upload: the agent cannot set its cache_salt",
    "/v1/completions/render": "renders a prompt for another engine; not served to clients",
    "/v1/chat/completions/render": "renders a prompt for another engine; not served to clients",
    "/v1/responses/render": "renders a prompt for another engine; not served to clients",
    "/v1/messages/render": "renders a prompt for another engine; not served to clients",
    "/cohere/v2/chat": "its request has no cache_salt: tenant isolation cannot hold",
    "/v1/systemone": "experimental structured decisions; not part of the served API",
    "/v1/realtime": "a WebSocket audio stream: the agent proxies HTTP requests only",
}


def lookup(path: str) -> tuple[str, Route] | None:
    """The canonical path and its route, or None (404). One trailing slash is the same route."""
    canonical = path[:-1] if path.endswith("/") and len(path) > 1 else path
    route = ROUTES.get(canonical)
    return (canonical, route) if route is not None else None
