"""A SageMaker real-time endpoint as a benchmark target: InvokeEndpointWithResponseStream, SigV4 through boto3.

The endpoint's container (the agent in front of vLLM or TensorRT-LLM) answers ``/invocations`` with the same
completion-shaped body and server-sent events as ``/v1/completions``; SageMaker wraps the bytes in PayloadPart
events of its event stream (botocore decodes the framing). Each part is timed as botocore hands it over, and the
SSE inside is parsed exactly as the HTTP path parses it, so the two paths report the same quantities.

boto3 is synchronous: each request runs in a worker thread of a pool as large as the level's concurrency (the
default executor would cap concurrency at a handful of threads), with one connection per worker and no retries
(a retried request would report the retry's timing as the first's).
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, EventStreamError, NoCredentialsError

from kvfleet.bench.client import PROMPT_TOKEN_IDS, BenchError, Result, completion_body, feed_sse, finish_stream

SCHEME = "sagemaker:"  # the URL form kvfleet bench takes: sagemaker:<endpoint name>[/<inference component>]


@dataclass(frozen=True, kw_only=True)
class SageMakerTarget:
    endpoint_name: str
    # The inference component a request names, where the endpoint hosts components (InvokeEndpoint
    # InferenceComponentName); None: a production variant's endpoint.
    inference_component: str | None = None
    region: str | None = None
    endpoint_url: str | None = None  # a VPC endpoint, or a local stand-in


class SageMakerTransport:
    def __init__(self, target: SageMakerTarget, *, workers: int, timeout_s: float, session: Any = None) -> None:
        self.target = target
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="kvfleet-bench")
        try:
            # ``session``: a boto3 Session holding other credentials (kvfleet check's assumed role).
            self.client: Any = (session or boto3).client(
                "sagemaker-runtime",
                region_name=target.region,
                endpoint_url=target.endpoint_url,
                config=Config(
                    max_pool_connections=max(10, workers),
                    read_timeout=timeout_s,
                    connect_timeout=10,
                    retries={"total_max_attempts": 1},
                ),
            )
        except BotoCoreError as err:  # NoRegionError and the like
            raise BenchError(f"cannot call SageMaker: {err}; pass --region", field="region") from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def invoke(self, model: str | None, prompt: list[int], max_tokens: int) -> Result:
        body = completion_body(model, prompt, max_tokens)
        res = Result(prompt_tokens=len(prompt), max_tokens=max_tokens, sent_s=time.perf_counter())
        buf = b""
        chunks = 0
        try:
            component = (
                {"InferenceComponentName": self.target.inference_component} if self.target.inference_component else {}
            )
            resp = self.client.invoke_endpoint_with_response_stream(
                EndpointName=self.target.endpoint_name,
                **component,
                Body=json.dumps(body).encode(),
                ContentType="application/json",
                Accept="text/event-stream",
            )
            res.status = 200
            for event in resp["Body"]:
                now = time.perf_counter()
                part = event.get("PayloadPart")
                if part is None:
                    continue
                buf, n = feed_sse(res, buf + part.get("Bytes", b""), now)
                chunks += n
            finish_stream(res, buf, chunks)
        except EventStreamError as err:  # ModelStreamError, InternalStreamFailure inside the stream
            res.error = f"the stream ended with {err.response.get('Error', {}).get('Code', 'an error')}: {err}"
        except NoCredentialsError:
            raise  # the probe says it in one line
        except ClientError as err:
            meta = err.response.get("ResponseMetadata", {})
            res.status = int(meta.get("HTTPStatusCode") or 0) or None
            res.error = f"{err.response.get('Error', {}).get('Code', 'ClientError')}: {err}"
        except BotoCoreError as err:
            res.error = f"{type(err).__name__}: {err}"
        res.done_s = time.perf_counter()
        return res

    async def send(self, model: str | None, prompt: list[int], *, max_tokens: int) -> Result:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.invoke, model, prompt, max_tokens)

    async def probe(self, model: str | None) -> None:
        """One short request first, so that a wrong name, region or credentials is one line, not a run of errors."""
        loop = asyncio.get_running_loop()
        try:
            res = await loop.run_in_executor(self.pool, self._probe, model)
        except NoCredentialsError:
            raise BenchError(
                "no AWS credentials for SageMaker; set AWS_PROFILE or the usual AWS variables", field="url"
            ) from None
        if res.error is not None and res.status is not None and 400 <= res.status < 500:
            raise BenchError(
                f"SageMaker refused {self.target.endpoint_name!r}: {res.error[:200]}", field="url"
            ) from None
        if res.error is not None and res.status is None:
            raise BenchError(f"cannot reach SageMaker: {res.error[:200]}", field="url") from None

    def _probe(self, model: str | None) -> Result:
        return self.invoke(model, [PROMPT_TOKEN_IDS[0]], 1)
