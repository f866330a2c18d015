"""`kvfleet bench sagemaker:<name>` against a local stand-in for the SageMaker runtime: SigV4-signed requests from
boto3 to InvokeEndpointWithResponseStream, answered in the AWS event-stream framing (prelude, headers, payload,
CRC32s: the "Event Stream Encoding" of the AWS SDKs, which botocore decodes), PayloadPart events carrying the
container's server-sent events split across parts the way SageMaker forwards bytes."""

from __future__ import annotations

import asyncio
import binascii
import json
from typing import Any

import pytest
from aiohttp import web

from tests.bench.test_bench import one_line, serving


def frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream message: total and headers length, prelude CRC, string headers (type 7), payload, CRC."""
    hb = b"".join(
        bytes([len(k)]) + k.encode() + b"\x07" + len(v).to_bytes(2, "big") + v.encode() for k, v in headers.items()
    )
    total = 12 + len(hb) + len(payload) + 4
    prelude = total.to_bytes(4, "big") + len(hb).to_bytes(4, "big")
    message = prelude + binascii.crc32(prelude).to_bytes(4, "big") + hb + payload
    return message + binascii.crc32(message).to_bytes(4, "big")


def payload_part(data: bytes) -> bytes:
    return frame(
        {":event-type": "PayloadPart", ":content-type": "application/octet-stream", ":message-type": "event"}, data
    )


@pytest.fixture(autouse=True)
def _credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "t"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def runtime(seen: list[dict[str, Any]], *, broken: bool = False) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        if request.match_info["tail"] != "endpoints/chat/invocations-response-stream":
            return web.json_response(
                {"message": "Endpoint nope of account 123456789012 not found."},
                status=400,
                headers={"x-amzn-ErrorType": "ValidationError"},
            )
        body = await request.json()
        seen.append({"body": body, "auth": request.headers.get("Authorization", "")})
        resp = web.StreamResponse(
            headers={
                "Content-Type": "application/vnd.amazon.eventstream",
                "X-Amzn-SageMaker-Content-Type": "text/event-stream",
            }
        )
        await resp.prepare(request)
        sse = b"".join(b'data: {"choices": [{"text": "t"}]}\n\n' for _ in range(body["max_tokens"]))
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        sse += f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
        # Parts cut every 23 bytes: events straddle parts, as SageMaker forwards whatever the container wrote.
        for i in range(0, len(sse), 23):
            if broken and i > 40:
                err = {"Message": "the container closed the connection", "ErrorCode": "StreamBroken"}
                await resp.write(
                    frame(
                        {":exception-type": "ModelStreamError", ":content-type": "application/json",
                         ":message-type": "exception"},
                        json.dumps(err).encode(),
                    )
                )  # fmt: skip
                break
            await resp.write(payload_part(sse[i : i + 23]))
            await asyncio.sleep(0.002)
        return resp

    return handler


def test_a_sagemaker_endpoint_through_the_runtime_api(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[dict[str, Any]] = []
    with serving(runtime(seen)) as url:
        code, out, err = one_line(
            capsys, "sagemaker:chat", "--region", "us-east-1", "--endpoint-url", url, "--concurrency", "1,3",
            "--requests", "3", "--input-tokens", "9", "--output-tokens", "4", "--json",
        )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    for level in report["levels"]:
        assert level["completed"] == 3 and level["failed"] == {}
        assert level["itl_s"] is not None and level["ttft_s"]["p50"] > 0
    assert report["kv_cache"] is None  # SageMaker exposes no /metrics
    # Signed with SigV4 for the SageMaker service, a completion body of exact lengths (after the one-token probe).
    assert all(s["auth"].startswith("AWS4-HMAC-SHA256 ") and "/sagemaker/aws4_request" in s["auth"] for s in seen)
    assert [(len(s["body"]["prompt"]), s["body"]["max_tokens"]) for s in seen[1:]] == [(9, 4)] * 6


def test_an_unknown_endpoint_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(runtime([])) as url:
        code, _, err = one_line(capsys, "sagemaker:nope", "--region", "us-east-1", "--endpoint-url", url)
    assert code == 2
    [line] = err.strip().splitlines()
    assert "SageMaker refused 'nope': ValidationError" in line and "not found" in line


def test_a_stream_error_fails_the_request_with_its_code(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(runtime([], broken=True)) as url:
        code, out, err = one_line(
            capsys, "sagemaker:chat", "--region", "us-east-1", "--endpoint-url", url, "--concurrency", "1",
            "--requests", "2", "--output-tokens", "6", "--json",
        )  # fmt: skip
    # The probe (one token) fits before the break; the requests do not.
    assert code == 1, err
    [level] = json.loads(out)["levels"]
    assert level["completed"] == 0 and level["failed"] == {"stream": 2}
    assert any("ModelStreamError" in e for e in level["first_errors"]), level


def test_not_an_endpoint_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = one_line(capsys, "sagemaker:bad_name!")
    assert code == 2 and "is not a SageMaker endpoint or inference component name" in err
