"""The ``kvfleet-agent`` command: ``kvfleet-agent [serve]`` serves; ``kvfleet-agent drain`` drains a running agent.

The second form (``contract.DRAIN_COMMAND``) is what a Kubernetes preStop hook runs: it returns when the
replica has drained, and the pod's SIGTERM then finds nothing left to wait for. ``python -m kvfleet.agent``
runs the same ``main``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import Coroutine
from typing import Any

from kvfleet import contract
from kvfleet.agent.settings import AgentSettings, SettingsError, from_env

log = logging.getLogger("kvfleet.agent")

DRAIN = contract.DRAIN_COMMAND[1]


async def _hf_token(settings: AgentSettings) -> dict[str, str]:
    """The Hugging Face token for gated models, read from Secrets Manager at start-up (never stored)."""
    arn = settings.hf_token_secret_arn
    if not arn:
        return {}
    from kvfleet.agent import aws

    try:
        client = await asyncio.to_thread(aws.client, "secretsmanager", settings.region)
        answer = await aws.call(
            lambda: client.get_secret_value(SecretId=arn), what="GetSecretValue", retry=aws.Retry(), log=log
        )
        value = str(answer["SecretString"]).strip()
    except Exception as err:  # the engine then fails on the gated download, visibly
        log.error("could not read the Hugging Face token from %s: %s", arn, err)
        return {}
    return {"HF_TOKEN": value, "HUGGING_FACE_HUB_TOKEN": value}


async def _tenant_secret(settings: AgentSettings) -> AgentSettings | None:
    """The tenant salt key from Secrets Manager, where the stacks named one. None when it cannot be read: serving
    without isolation would let one tenant probe another's prefix cache, so the agent does not serve at all."""
    arn = settings.tenant_secret_arn
    if not arn or settings.tenant_secret is not None:
        return settings
    from kvfleet.agent import aws

    try:
        client = await asyncio.to_thread(aws.client, "secretsmanager", settings.region)
        answer = await aws.call(
            lambda: client.get_secret_value(SecretId=arn), what="GetSecretValue", retry=aws.Retry(), log=log
        )
        value = str(answer["SecretString"]).strip()
    except Exception as err:
        log.error("cannot read the tenant salt key from %s (%s): not serving without tenant isolation", arn, err)
        return None
    if not value:
        log.error("the tenant salt key in %s is empty: not serving without tenant isolation", arn)
        return None
    return dataclasses.replace(settings, tenant_secret=value.encode())


async def serve(settings: AgentSettings) -> int:
    from kvfleet.agent import aws, engine, lifecycle, metrics
    from kvfleet.agent.server import Agent

    isolated = await _tenant_secret(settings)
    if isolated is None:
        return 2
    settings = isolated
    # The engine's orphans (vLLM's EngineCore after its API server died) are re-parented here, to be killed
    # and reaped, instead of to PID 1 where they would keep the accelerator's memory.
    engine.become_subreaper()

    try:
        watcher = lifecycle.watcher_from_env(os.environ)
    except ValueError as err:
        print(f"{contract.AGENT_COMMAND}: {err}", file=sys.stderr)
        return 2
    publisher = None
    if settings.put_metric_data:
        publisher = metrics.CloudWatchPublisher(
            client=await asyncio.to_thread(aws.client, "cloudwatch", settings.region),
            namespace=settings.namespace,
            deployment=settings.deployment,
            replica=settings.replica,
        )
    extra_env = await _hf_token(settings)
    supervisor = engine.EngineSupervisor(settings, extra_env=extra_env)
    agent = Agent(settings, engine=supervisor, publisher=publisher)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.request_shutdown)
    try:
        await agent.start()
        if watcher is not None:
            agent.add_background(watcher.run(agent.drain), "lifecycle")
        await agent.shutdown_requested.wait()
        await agent.shutdown()
    finally:
        # Whatever ended serving (a failed start, an exception in the shutdown): no engine outlives the agent.
        # After a clean shutdown this finds the engine stopped and does nothing.
        await supervisor.stop(timeout=30)
    log.info("stopped (drain %s)", "clean" if agent.drained else "past its budget")
    return 0


def drain_client(port: int) -> int:
    url = f"http://127.0.0.1:{port}{contract.DRAIN_ROUTE}?wait=1"
    req = urllib.request.Request(url, method="POST", data=b"")
    try:
        with urllib.request.urlopen(req, timeout=None) as r:
            print(r.read().decode())
        return 0
    except urllib.error.URLError as err:
        print(f"{contract.AGENT_COMMAND}: drain request failed: {err.reason}", file=sys.stderr)
        return 1


def _drain_port() -> int:
    """The port to drain when the environment is not fully valid: the stack's, or the contract's."""
    raw = os.environ.get(contract.ENV_PORT, "")
    return int(raw) if raw.isdigit() else contract.SERVING_PORT


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop  # a faster event loop: the proxy hop is on every token's path
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [contract.SERVE_ARG]:
        argv = argv[1:]  # SageMaker starts every inference container as `<entrypoint> serve`
    raw_level = os.environ.get(contract.ENV_LOG_LEVEL) or "INFO"
    level = int(raw_level) if raw_level.isdigit() else logging.getLevelNamesMapping().get(raw_level.upper())
    if level is None:
        print(f"{contract.AGENT_COMMAND}: {contract.ENV_LOG_LEVEL}: not a log level: {raw_level!r}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s {contract.AGENT_COMMAND} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        settings = from_env()
    except SettingsError as err:
        if argv[:1] == [DRAIN]:
            return drain_client(_drain_port())
        print(f"{contract.AGENT_COMMAND}: {err}", file=sys.stderr)
        return 2
    if argv[:1] == [DRAIN]:
        return drain_client(settings.port)
    if argv:
        print(
            f"{contract.AGENT_COMMAND}: unknown command {argv[0]!r}; use {contract.SERVE_ARG} (or nothing) or {DRAIN}",
            file=sys.stderr,
        )
        return 2
    log.info(
        "contract %d; engine %s %s; serving on %s:%d",
        contract.CONTRACT_VERSION,
        settings.engine,
        settings.engine_version,
        settings.host,
        settings.port,
    )
    from kvfleet.agent import engine

    # Here, not in serve: before any thread or the engine starts (threads inherit the policy, the engine gets the
    # agent's own back), and only in the agent's process.
    engine.defer_to_engine()
    try:
        return _run(serve(settings))
    finally:
        engine.kill_all()  # the last resort, where the event loop ended before the engine's stop could run


if __name__ == "__main__":
    sys.exit(main())
