"""The agent's route table held to the routes of vLLM releases newer than the one installed for the tests.

``test_vllm_integration.py`` reads the OpenAPI document of the pinned vLLM (0.32) and cannot see a later release's
routes. These were read from the PyPI sdists of vLLM 0.33.0 and 0.34.0 (every ``@router.get/post``,
``add_api_route`` and ``websocket`` of the API server under ``vllm/entrypoints``; not the KV connectors' own side
servers, the data-parallel supervisor's probes, or the ``/metrics`` and ``/static`` mounts) and are kept here as
data: the test reads nothing at run time. What they changed against 0.32.0:

- 0.33.0 adds ``POST /v1/decisions`` (always registered; 501 where the model has no decisions handler). The model
  reads ``input`` once per question (max_tokens 1) and answers with probabilities; its ``DecisionRequest`` takes
  ``cache_salt``, has no generation limit and forbids undeclared fields.
- 0.34.0 moves ``/fault_tolerance/status`` and ``/fault_tolerance/apply`` to ``/v1/fault_tolerance/...`` and adds
  ``GET /checkpoint/status``, ``POST /checkpoint/prepare``, ``POST /checkpoint/restore`` (generate models with
  ``--enable-sleep-mode``): administrative, never reachable through the agent.

A second test runs the agent in front of the fake engine: ``/v1/decisions`` is gated, salted per tenant and admitted
as ``/v1/completions`` is, and the new administrative paths are the agent's own 404.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum
from typing import Any

import pytest

from kvfleet import contract
from kvfleet.agent import routes
from kvfleet.agent.tenancy import cache_salt
from tests.agent.harness import fake_engine_command, run, running, settings, stream_completion


class Kind(Enum):
    GENERATES = "runs the model over a client's prompt and returns tokens or token probabilities"
    POOLS = "runs the model and returns vectors or scores (pooling models)"
    ADMIN = "changes or exposes the engine's state: weights, caches, sleep, profiling, scaling, recovery"
    OTHER = "runs no model: tokenizer, model list, version, probes, docs, prompt renderers, stored responses"


@dataclass(frozen=True)
class EngineRoute:
    method: str  # WS: a WebSocket route
    path: str
    source: str  # in the sdist
    kind: Kind
    releases: frozenset[str]
    salt: bool = False  # GENERATES: its request takes cache_salt in these releases


V33, V34 = "0.33.0", "0.34.0"
BOTH = frozenset({V33, V34})
ONLY_33 = frozenset({V33})
ONLY_34 = frozenset({V34})
RELEASES = (V33, V34)

_E = "vllm/entrypoints/"
_RL = _E + "rl/online/api_router.py"
_SLEEP = _E + "serve/dev/sleep/api_router.py"
_CACHE = _E + "serve/dev/cache/api_router.py"
_FT = _E + "serve/fault_tolerance/api_router.py"
_CKPT = _E + "serve/checkpoint/api_router.py"
_TITO = _E + "scale_out/token_in_token_out/api_router.py"
_RENDER = _E + "scale_out/render/api_router.py"
_DERENDER = _E + "scale_out/derender/api_router.py"
_SCORING = _E + "pooling/scoring/api_router.py"
_BASIC = _E + "serve/instrumentator/basic.py"
_TOKENIZE = _E + "serve/tokenize/api_router.py"
_SAGEMAKER = _E + "serve/sagemaker/api_router.py"
_RESPONSES = _E + "openai/responses/api_router.py"
_CHAT = _E + "openai/chat_completion/api_router.py"
_ANTHROPIC = _E + "anthropic/api_router.py"
_LORA = _E + "serve/lora/api_router.py"
_ELASTIC = _E + "serve/elastic_ep/api_router.py"
_PROFILE = _E + "serve/profile/api_router.py"

G, P, A, N = Kind.GENERATES, Kind.POOLS, Kind.ADMIN, Kind.OTHER  # N: no model run

VLLM_ROUTES: tuple[EngineRoute, ...] = (
    # Generation and model reads over a client's prompt.
    EngineRoute("POST", "/v1/completions", _E + "openai/completion/api_router.py", G, BOTH, salt=True),
    EngineRoute("POST", "/v1/chat/completions", _CHAT, G, BOTH, salt=True),
    EngineRoute("POST", "/v1/chat/completions/batch", _CHAT, G, BOTH, salt=True),
    EngineRoute("POST", "/v1/responses", _RESPONSES, G, BOTH, salt=True),
    EngineRoute("POST", "/v1/messages", _ANTHROPIC, G, BOTH, salt=True),
    EngineRoute("POST", "/invocations", _SAGEMAKER, G, BOTH, salt=True),  # dispatched to completions or chat
    EngineRoute("POST", "/inference/v1/generate", _TITO, G, BOTH, salt=True),
    EngineRoute("POST", "/generative_scoring", _E + "generate/generative_scoring/api_router.py", G, BOTH, salt=True),
    EngineRoute("POST", "/v1/decisions", _E + "openai/decisions/api_router.py", G, BOTH, salt=True),
    EngineRoute("POST", "/v1/systemone", _E + "generate/structured_decisions/api_router.py", G, BOTH, salt=True),
    EngineRoute("POST", "/cohere/v2/chat", _E + "cohere/api_router.py", G, BOTH),
    EngineRoute("POST", "/v1/audio/transcriptions", _E + "speech_to_text/transcription/api_router.py", G, BOTH),
    EngineRoute("POST", "/v1/audio/translations", _E + "speech_to_text/translation/api_router.py", G, BOTH),
    EngineRoute("WS", "/v1/realtime", _E + "speech_to_text/realtime/api_router.py", G, BOTH),
    # Pooling.
    EngineRoute("POST", "/v1/embeddings", _E + "pooling/embed/api_router.py", P, BOTH),
    EngineRoute("POST", "/v1/embeddings", _E + "pooling/token_embed/api_router.py", P, BOTH),
    EngineRoute("POST", "/v2/embed", _E + "pooling/embed/api_router.py", P, BOTH),
    EngineRoute("POST", "/classify", _E + "pooling/classify/api_router.py", P, BOTH),
    EngineRoute("POST", "/pooling", _E + "pooling/pooling/api_router.py", P, BOTH),
    EngineRoute("POST", "/score", _SCORING, P, BOTH),
    EngineRoute("POST", "/v1/score", _SCORING, P, BOTH),
    EngineRoute("POST", "/rerank", _SCORING, P, BOTH),
    EngineRoute("POST", "/v1/rerank", _SCORING, P, BOTH),
    EngineRoute("POST", "/v2/rerank", _SCORING, P, BOTH),
    # Administrative.
    EngineRoute("POST", "/fault_tolerance/apply", _FT, A, ONLY_33),
    EngineRoute("GET", "/fault_tolerance/status", _FT, A, ONLY_33),
    EngineRoute("POST", "/v1/fault_tolerance/apply", _FT, A, ONLY_34),
    EngineRoute("GET", "/v1/fault_tolerance/status", _FT, A, ONLY_34),
    EngineRoute("POST", "/checkpoint/prepare", _CKPT, A, ONLY_34),
    EngineRoute("POST", "/checkpoint/restore", _CKPT, A, ONLY_34),
    EngineRoute("GET", "/checkpoint/status", _CKPT, A, ONLY_34),
    EngineRoute("POST", "/abort_requests", _RL, A, BOTH),
    EngineRoute("POST", "/abort_requests", _TITO, A, BOTH),
    EngineRoute("POST", "/inference/v1/abort_requests", _TITO, A, BOTH),
    EngineRoute("POST", "/pause", _RL, A, BOTH),
    EngineRoute("POST", "/resume", _RL, A, BOTH),
    EngineRoute("GET", "/is_paused", _RL, A, BOTH),
    EngineRoute("GET", "/get_world_size", _RL, A, BOTH),
    EngineRoute("POST", "/init_weight_transfer_engine", _RL, A, BOTH),
    EngineRoute("POST", "/shutdown_weight_transfer_engine", _RL, A, BOTH),
    EngineRoute("POST", "/start_weight_update", _RL, A, BOTH),
    EngineRoute("POST", "/start_draft_weight_update", _RL, A, BOTH),
    EngineRoute("POST", "/finish_weight_update", _RL, A, BOTH),
    EngineRoute("POST", "/update_weights", _RL, A, BOTH),
    EngineRoute("POST", "/update_weight_version", _RL, A, BOTH),
    EngineRoute("POST", "/weight_checker", _RL, A, BOTH),
    EngineRoute("GET", "/weight_info", _RL, A, BOTH),
    EngineRoute("POST", "/collective_rpc", _E + "serve/dev/rpc/api_router.py", A, BOTH),
    EngineRoute("POST", "/sleep", _SLEEP, A, BOTH),
    EngineRoute("POST", "/wake_up", _SLEEP, A, BOTH),
    EngineRoute("GET", "/is_sleeping", _SLEEP, A, BOTH),
    EngineRoute("POST", "/release_kv_cache_memory", _SLEEP, A, BOTH),
    EngineRoute("POST", "/reset_prefix_cache", _CACHE, A, BOTH),
    EngineRoute("POST", "/reset_mm_cache", _CACHE, A, BOTH),
    EngineRoute("POST", "/reset_encoder_cache", _CACHE, A, BOTH),
    EngineRoute("GET", "/server_info", _E + "serve/dev/server_info/api_router.py", A, BOTH),
    EngineRoute("POST", "/start_profile", _PROFILE, A, BOTH),
    EngineRoute("POST", "/stop_profile", _PROFILE, A, BOTH),
    EngineRoute("POST", "/scale_elastic_ep", _ELASTIC, A, BOTH),
    EngineRoute("POST", "/is_scaling_elastic_ep", _ELASTIC, A, BOTH),
    EngineRoute("POST", "/v1/load_lora_adapter", _LORA, A, BOTH),
    EngineRoute("POST", "/v1/unload_lora_adapter", _LORA, A, BOTH),
    EngineRoute("GET", "/kv_event_sources", _BASIC, A, BOTH),
    EngineRoute("GET", "/load", _BASIC, A, BOTH),
    # No model run. The render routes are in REFUSED (they take generation limits; the OpenAPI test names them).
    EngineRoute("GET", "/v1/models", _E + "openai/models/api_router.py", N, BOTH),
    EngineRoute("GET", "/version", _BASIC, N, BOTH),
    EngineRoute("POST", "/tokenize", _TOKENIZE, N, BOTH),
    EngineRoute("POST", "/detokenize", _TOKENIZE, N, BOTH),
    EngineRoute("GET", "/tokenizer_info", _TOKENIZE, N, BOTH),
    EngineRoute("POST", "/v1/messages/count_tokens", _ANTHROPIC, N, BOTH),
    EngineRoute("GET", "/health", _E + "serve/instrumentator/health.py", N, BOTH),
    EngineRoute("GET", "/ping", _SAGEMAKER, N, BOTH),
    EngineRoute("POST", "/ping", _SAGEMAKER, N, BOTH),
    EngineRoute("GET", "/docs", _E + "serve/instrumentator/offline_docs.py", N, BOTH),
    EngineRoute("POST", "/v1/completions/render", _RENDER, N, BOTH),
    EngineRoute("POST", "/v1/chat/completions/render", _RENDER, N, BOTH),
    EngineRoute("POST", "/v1/responses/render", _RENDER, N, BOTH),
    EngineRoute("POST", "/v1/messages/render", _RENDER, N, BOTH),
    EngineRoute("POST", "/cohere/v2/chat/render", _E + "cohere/api_router.py", N, BOTH),
    EngineRoute("POST", "/v1/completions/derender", _DERENDER, N, BOTH),
    EngineRoute("POST", "/v1/chat/completions/derender", _DERENDER, N, BOTH),
    EngineRoute("GET", "/v1/responses/{response_id}", _RESPONSES, N, BOTH),
    EngineRoute("POST", "/v1/responses/{response_id}/cancel", _RESPONSES, N, BOTH),
)


def _in(release: str, kind: Kind | None = None) -> list[EngineRoute]:
    return [r for r in VLLM_ROUTES if release in r.releases and (kind is None or r.kind is kind)]


def _ids(rows: list[EngineRoute]) -> list[str]:
    return [f"{r.method} {r.path}" for r in rows]


_GENERATING = [(v, r) for v in RELEASES for r in _in(v, Kind.GENERATES)]
_ADMIN = [(v, r) for v in RELEASES for r in _in(v, Kind.ADMIN)]


@pytest.mark.parametrize(("release", "route"), _GENERATING, ids=[f"{v} {r.path}" for v, r in _GENERATING])
def test_every_route_that_runs_the_model_on_a_prompt_is_a_salted_generation_route_or_refused(
    release: str, route: EngineRoute
) -> None:
    found = routes.lookup(route.path)
    if found is not None and found[1].generates:
        assert route.salt, f"vLLM {release} {route.path}: the agent salts it, the engine takes no cache_salt"
        assert route.method in found[1].methods
    else:
        assert found is None, f"vLLM {release} {route.path} runs the model: forwarded without the gate"
        assert route.path in routes.REFUSED, f"vLLM {release} {route.path}: add it to ROUTES or REFUSED"


def test_the_decisions_api_is_a_generation_route() -> None:
    # vLLM 0.33.0 on: a client salt would let one tenant probe another's prefix cache (the answer carries the
    # cached-token count), so the agent sets it as on every generation route.
    assert routes.lookup("/v1/decisions") == ("/v1/decisions", routes.GENERATE)
    assert routes.lookup("/v1/decisions/") == ("/v1/decisions", routes.GENERATE)
    assert "/v1/decisions" not in routes.REFUSED


@pytest.mark.parametrize(("release", "route"), _ADMIN, ids=[f"{v} {r.method} {r.path}" for v, r in _ADMIN])
def test_every_administrative_route_is_404_at_the_agent(release: str, route: EngineRoute) -> None:
    assert route.path not in routes.ROUTES
    assert routes.lookup(route.path) is None and routes.lookup(route.path + "/") is None
    assert route.path not in {contract.HEALTH_ROUTE, contract.METRICS_ROUTE, contract.DRAIN_ROUTE}


@pytest.mark.parametrize("release", RELEASES)
def test_pooling_routes_are_never_forwarded_without_the_gate(release: str) -> None:
    for route in _in(release, Kind.POOLS):
        found = routes.lookup(route.path)
        assert found is None or found[1].generates, f"vLLM {release} {route.path}"


@pytest.mark.parametrize("release", RELEASES)
def test_every_forwarded_route_is_still_an_engine_route_of_its_kind(release: str) -> None:
    # A route renamed or dropped in a release would otherwise be forwarded to a path the engine no longer serves,
    # and a model or administrative route would never be forwarded as read-only.
    rows = _in(release)
    for path, route in routes.ROUTES.items():
        same = [r for r in rows if r.path == path and r.method in route.methods]
        assert same, f"{path} is not a route of vLLM {release}"
        want = {Kind.GENERATES} if route.generates else {Kind.OTHER}
        assert {r.kind for r in same} <= want, (path, release, _ids(same))


def test_the_release_lists_say_what_changed() -> None:
    # The data itself: what 0.33.0 and 0.34.0 changed, as the module's docstring says.
    assert {r.path for r in VLLM_ROUTES if r.releases == ONLY_33} == {
        "/fault_tolerance/apply",
        "/fault_tolerance/status",
    }
    assert {r.path for r in VLLM_ROUTES if r.releases == ONLY_34} == {
        "/v1/fault_tolerance/apply",
        "/v1/fault_tolerance/status",
        "/checkpoint/prepare",
        "/checkpoint/restore",
        "/checkpoint/status",
    }
    keys = [(r.method, r.path, r.source) for r in VLLM_ROUTES]
    assert len(keys) == len(set(keys))


# ---- in front of the fake engine --------------------------------------------------------------------------------

DECISION = {
    "model": "fake",
    "input": "The invoice is dated 3 March and is unpaid.",
    "questions": [
        {"type": "predicate", "instructions": "Is the invoice overdue?"},
        {"type": "choice", "instructions": "Which month?", "choices": [{"value": "March"}, {"value": "April"}]},
    ],
}
COMPLETION = {"model": "fake", "prompt": "x", "max_tokens": 1}
ADMIN_PATHS = (
    ("POST", "/v1/fault_tolerance/apply"),
    ("GET", "/v1/fault_tolerance/status"),
    ("POST", "/fault_tolerance/apply"),
    ("GET", "/fault_tolerance/status"),
    ("POST", "/checkpoint/prepare"),
    ("POST", "/checkpoint/restore"),
    ("GET", "/checkpoint/status"),
)


def test_decisions_are_gated_salted_and_admitted_as_completions_are() -> None:
    async def go() -> None:
        s = settings(tenant_header="X-Tenant", tenant_secret=b"s3cret")
        async with running(s) as r:

            async def post(path: str, body: dict[str, Any], tenant: str | None = None) -> tuple[int, Any]:
                headers = {"X-Tenant": tenant} if tenant is not None else {}
                async with r.http.post(r.url + path, json=body, headers=headers) as c:
                    return c.status, await c.json()

            # No tenant header: refused by the agent, the same answer as for completions.
            salted = {"cache_salt": "tenant-b"}
            completion = await post("/v1/completions", {**COMPLETION, **salted})
            for path in ("/v1/decisions", "/v1/decisions/"):
                status, body = await post(path, {**DECISION, **salted})
                assert status == 400 == completion[0], path
                assert body["error"] == completion[1]["error"] and "X-Tenant" in body["error"]["message"]
            # With it: the engine sees the tenant's salt, never the client's, and nothing it does not declare.
            for path in ("/v1/decisions", "/v1/decisions/"):
                status, body = await post(path, {**DECISION, **salted}, tenant="a")
                assert status == 200, body
                assert body["echo"]["cache_salt"] == cache_salt(b"s3cret", "a") != "tenant-b"
                assert body["echo"] == {**DECISION, "cache_salt": cache_salt(b"s3cret", "a")}
                assert len(body["answers"]) == 2
            status, body = await post("/v1/decisions", DECISION, tenant="b")  # no client salt: still set
            assert status == 200 and body["echo"]["cache_salt"] == cache_salt(b"s3cret", "b")
            status, body = await post("/v1/completions", {**COMPLETION, **salted}, tenant="a")
            assert status == 200 and body["echo"]["cache_salt"] == cache_salt(b"s3cret", "a")
            async with r.http.get(r.url + "/v1/decisions") as c:
                assert c.status == 405 and c.headers["Allow"] == "POST"
            # vLLM 0.34.0's administrative routes (and 0.33.0's names for fault tolerance): the agent's own 404.
            for method, path in ADMIN_PATHS:
                async with r.http.request(method, r.url + path, json={}, headers={"X-Tenant": "a"}) as c:
                    assert c.status == 404, (method, path)
                    assert (await c.json())["error"]["type"] == "not_found_error", (method, path)
        # Admission: with no generation limit a decision reserves its prompt plus the rest of the context window
        # (max_model_len 1,024 here), as a completion without max_tokens does; past the budget both are 429.
        s = settings(engine_command=fake_engine_command(token_delay=0.05), token_budget=150, admission_factor=1.0)
        async with running(s) as r:
            first = asyncio.create_task(stream_completion(r.http, r.url, max_tokens=100))
            await asyncio.sleep(0.3)
            for path, body in (("/v1/decisions", DECISION), ("/v1/completions", {"model": "fake", "prompt": "x"})):
                async with r.http.post(r.url + path, json=body) as c:
                    assert c.status == 429, path
                    assert (await c.json())["error"]["type"] == "rate_limit_exceeded"
            assert (await first)["status"] == 200
            assert r.agent.admission.reserved_tokens == 0
            async with r.http.post(r.url + "/v1/decisions", json=DECISION) as c:  # an idle replica takes it
                assert c.status == 200
            assert r.agent.admission.reserved_tokens == 0
            assert (r.agent.admission.admitted, r.agent.admission.shed) == (2, 2)

    run(go)


def test_the_engines_501_for_a_missing_api_is_passed_on_and_not_counted_as_a_server_error() -> None:
    # vLLM answers /v1/decisions with 501 where the model has no Decisions API; a client can ask for it at will, so
    # counting it in ServerErrors would let users trip the rollback alarm on a healthy release.
    async def go() -> None:
        s = settings(engine_command=(*fake_engine_command(), "--no-decisions"))
        async with running(s) as r:
            for _ in range(3):
                async with r.http.post(r.url + "/v1/decisions", json=DECISION) as c:
                    assert c.status == 501
                    assert (await c.json())["error"]["message"] == "The model does not support the Decisions API"
            async with r.http.post(r.url + "/v1/completions", json=COMPLETION) as c:
                assert c.status == 200  # the replica still serves
            await asyncio.sleep(0.5)
            assert sum(rec.get("ServerErrors", 0) for rec in r.emf()) == 0
            assert r.agent.admission.reserved_tokens == 0

    run(go)
