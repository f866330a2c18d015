"""Per-tenant prefix-cache isolation: the engine's cache_salt, derived server-side from a trusted tenant id.

vLLM and TensorRT-LLM hash ``cache_salt`` into a request's first KV block, so prefixes are shared only
among requests with the same salt. A salt the client chooses is no isolation (anyone can send another
tenant's), so the agent drops any client-supplied salt and sets HMAC-SHA256(secret, tenant id).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import MutableMapping
from typing import Any


def cache_salt(secret: bytes, tenant: str) -> str:
    return hmac.new(secret, tenant.encode("utf-8"), hashlib.sha256).hexdigest()


def apply_salt(body: MutableMapping[str, Any], *, secret: bytes, tenant: str) -> None:
    body.pop("cache_salt", None)
    body["cache_salt"] = cache_salt(secret, tenant)
