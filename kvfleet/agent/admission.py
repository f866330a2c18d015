"""Token-aware admission: shed load with 429 before queued work makes time-to-first-token unbounded.

Every admitted request reserves the tokens it can occupy in the KV cache (prompt + the most it may
generate) until it finishes. A request that would push reservations past the budget is refused with
429 and Retry-After, so clients back off or go to another replica instead of waiting in a queue that
only grows. The budget comes from the plan (what runs plus what can start within the TTFT target), given as a
factor on the KV-cache tokens; Retry-After is how long the recent release rate takes to free the difference.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Without the tokenizer the agent estimates: about 4 bytes of text per token for BPE vocabularies on
# English and code. Token-id prompts are counted exactly.
BYTES_PER_TOKEN = 4
# A request that names no generation limit may run to the end of the context window, and is charged for
# it; with no known window, this much.
DEFAULT_MAX_TOKENS = 256


def _text_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN)


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        return sum(_prompt_tokens(p) for p in prompt)
    return 0


def _message_tokens(messages: Any) -> int:
    total = 0
    if not isinstance(messages, list):
        return 0
    for m in messages:
        if isinstance(m, list):  # /v1/chat/completions/batch: a list of conversations
            total += _message_tokens(m)
            continue
        if not isinstance(m, Mapping):
            continue
        total += 4  # role and chat-template framing
        content = m.get("content")
        if isinstance(content, str):
            total += _text_tokens(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    total += _text_tokens(part["text"])
    return total


def _input_tokens(items: Any) -> int:
    """The Responses API's ``input``: a string, or items that are messages or carry text."""
    if isinstance(items, str):
        return _text_tokens(items)
    if not isinstance(items, list):
        return 0
    total = 0
    for item in items:
        if isinstance(item, Mapping):
            total += _message_tokens([item]) if "content" in item else _prompt_tokens(item.get("text"))
    return total


# Generation limits by API: OpenAI chat, OpenAI completions and Anthropic messages, OpenAI responses.
LIMIT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def prompt_tokens(body: Mapping[str, Any]) -> int:
    """The prompt's tokens, estimated: completions (``prompt``), chat and Anthropic messages (``messages``,
    ``system``) and responses (``input``, ``instructions``)."""
    if "messages" in body:
        prompt = _message_tokens(body["messages"])
    elif "input" in body:
        prompt = _input_tokens(body["input"])
    else:
        prompt = _prompt_tokens(body.get("prompt"))
    for framing in ("system", "instructions"):
        value = body.get(framing)
        prompt += _text_tokens(value) if isinstance(value, str) else _message_tokens(value) if value else 0
    return prompt


def request_tokens(body: Mapping[str, Any], *, max_model_len: int | None, prompt: int | None = None) -> int:
    """Tokens a generation request can hold in the KV cache: prompt (estimated unless given) plus its generation
    limit."""
    if prompt is None:
        prompt = prompt_tokens(body)
    raw_n = body.get("n")
    n = raw_n if isinstance(raw_n, int) and raw_n > 0 else 1
    limit = next((body[f] for f in LIMIT_FIELDS if body.get(f) is not None), None)
    if not isinstance(limit, int) or limit <= 0:
        limit = max(1, max_model_len - prompt) if max_model_len else DEFAULT_MAX_TOKENS
    if max_model_len:
        limit = min(limit, max(1, max_model_len - prompt))
    return prompt + n * limit


# Retry-After from how fast reservations are being released: over this window, and never more than the cap (a
# client told to wait minutes goes elsewhere anyway, and the estimate is only as good as the recent past).
RELEASE_WINDOW_S = 60.0
MAX_RETRY_AFTER_S = 60


@dataclass
class Admission:
    budget_tokens: int | None  # None: admit everything
    reserved_tokens: int = 0
    admitted: int = 0
    shed: int = 0
    clock: Callable[[], float] = time.monotonic
    _released: deque[tuple[float, int]] = field(default_factory=deque, repr=False)  # (when, tokens)
    _released_tokens: int = 0

    def retry_after_s(self, tokens: int, *, default: int) -> int:
        """Seconds until ``tokens`` more fit, at the rate reservations were released over the last minute: the
        queue's drain rate, as the agent sees it. ``default`` where nothing was released lately."""
        if self.budget_tokens is None:
            return default
        now = self.clock()
        self._forget(now)
        if not self._released:
            return default
        span = max(now - self._released[0][0], 5.0)  # a burst of releases is not a rate
        rate = self._released_tokens / span
        deficit = self.reserved_tokens + tokens - self.budget_tokens
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(deficit / rate)))

    def _forget(self, now: float) -> None:
        while self._released and now - self._released[0][0] > RELEASE_WINDOW_S:
            self._released_tokens -= self._released.popleft()[1]

    def try_reserve(self, tokens: int) -> bool:
        if self.budget_tokens is None:
            self.admitted += 1
            return True
        # An idle replica takes any request, even one larger than the budget: refusing it would be forever.
        if self.reserved_tokens and self.reserved_tokens + tokens > self.budget_tokens:
            self.shed += 1
            return False
        self.reserved_tokens += tokens
        self.admitted += 1
        return True

    def release(self, tokens: int) -> None:
        if self.budget_tokens is not None:
            self.reserved_tokens = max(0, self.reserved_tokens - tokens)
            now = self.clock()
            self._released.append((now, tokens))
            self._released_tokens += tokens
            self._forget(now)
