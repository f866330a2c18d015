"""Entry point: ``python -m kvfleet.agent`` serves; ``python -m kvfleet.agent drain`` drains a running agent.

The second form is what a Kubernetes preStop hook runs: it returns when the replica has drained, and
the pod's SIGTERM then finds nothing left to wait for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import urllib.error
import urllib.request

from kvfleet import contract
from kvfleet.agent.settings import AgentSettings, SettingsError, from_env

log = logging.getLogger("kvfleet.agent")


def _hf_token(settings: AgentSettings) -> dict[str, str]:
    """The Hugging Face token for gated models, read from Secrets Manager at start-up (never stored)."""
    if not settings.hf_token_secret_arn:
        return {}
    try:
        import boto3

        client = boto3.client("secretsmanager", region_name=settings.region)
        value = client.get_secret_value(SecretId=settings.hf_token_secret_arn)["SecretString"].strip()
    except Exception as err:  # the engine then fails on the gated download, visibly
        log.error("could not read the Hugging Face token from %s: %s", settings.hf_token_secret_arn, err)
        return {}
    return {"HF_TOKEN": value, "HUGGING_FACE_HUB_TOKEN": value}


async def serve(settings: AgentSettings) -> int:
    from kvfleet.agent import lifecycle, metrics
    from kvfleet.agent.engine import EngineSupervisor
    from kvfleet.agent.server import Agent

    publisher = None
    if settings.put_metric_data:
        import boto3

        publisher = metrics.CloudWatchPublisher(
            client=boto3.client("cloudwatch", region_name=settings.region),
            namespace=settings.namespace,
            deployment=settings.deployment,
            replica=settings.replica,
        )
    try:
        watcher = lifecycle.watcher_from_env(os.environ)
    except ValueError as err:
        print(f"kvfleet-agent: {err}", file=sys.stderr)
        return 2
    extra_env = await asyncio.to_thread(_hf_token, settings)
    agent = Agent(settings, engine=EngineSupervisor(settings, extra_env=extra_env), publisher=publisher)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.request_shutdown)
    await agent.start()
    if watcher is not None:
        agent.add_background(watcher.run(agent.drain), "lifecycle")
    await agent.shutdown_requested.wait()
    await agent.shutdown()
    log.info("stopped (drain %s)", "clean" if agent.drained else "past its budget")
    return 0


def drain_client(port: int) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/drain?wait=1", method="POST", data=b"")
    try:
        with urllib.request.urlopen(req, timeout=None) as r:
            print(r.read().decode())
        return 0
    except urllib.error.URLError as err:
        print(f"kvfleet-agent: drain request failed: {err.reason}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        argv = argv[1:]  # SageMaker starts every inference container as `<entrypoint> serve`
    logging.basicConfig(
        level=os.environ.get("KVFLEET_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s kvfleet-agent %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        settings = from_env()
    except SettingsError as err:
        if argv[:1] == ["drain"]:
            return drain_client(int(os.environ.get(contract.ENV_PORT, "8080")))
        print(f"kvfleet-agent: {err}", file=sys.stderr)
        return 2
    if argv[:1] == ["drain"]:
        return drain_client(settings.port)
    if argv:
        print(f"kvfleet-agent: unknown command {argv[0]!r}; use `serve` (or nothing) or `drain`", file=sys.stderr)
        return 2
    try:
        import uvloop  # a faster event loop: the proxy hop is on every token's path

        return uvloop.run(serve(settings))
    except ImportError:
        return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
