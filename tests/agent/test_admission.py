"""Token estimates and reservations behind the 429s."""

from __future__ import annotations

from kvfleet.agent.admission import Admission, request_tokens


def test_completion_tokens_are_prompt_plus_limit() -> None:
    assert request_tokens({"prompt": "abcdefgh", "max_tokens": 10}, max_model_len=None) == 2 + 10
    assert request_tokens({"prompt": [1, 2, 3], "max_tokens": 10}, max_model_len=None) == 3 + 10
    assert request_tokens({"prompt": ["abcd", "abcd"], "max_tokens": 5}, max_model_len=None) == 2 + 5
    assert request_tokens({"prompt": "x", "max_tokens": 10, "n": 3}, max_model_len=None) == 1 + 30


def test_chat_counts_messages_and_framing() -> None:
    body = {"messages": [{"role": "user", "content": "abcdefgh"}, {"role": "user", "content": [{"text": "abcd"}]}]}
    assert request_tokens({**body, "max_completion_tokens": 7}, max_model_len=None) == (4 + 2) + (4 + 1) + 7


def test_no_limit_is_charged_the_rest_of_the_window() -> None:
    assert request_tokens({"prompt": "abcd"}, max_model_len=1024) == 1024
    assert request_tokens({"prompt": "abcd", "max_tokens": 5000}, max_model_len=1024) == 1024
    assert request_tokens({"prompt": "abcd"}, max_model_len=None) == 1 + 256


def test_reservations() -> None:
    a = Admission(budget_tokens=100)
    assert a.try_reserve(60) and a.try_reserve(40)
    assert not a.try_reserve(1) and a.shed == 1
    a.release(60)
    assert a.try_reserve(50) and a.reserved_tokens == 90
    idle = Admission(budget_tokens=100)
    assert idle.try_reserve(500)  # an idle replica takes even an oversized request
    assert Admission(budget_tokens=None).try_reserve(10**9)


def test_responses_messages_and_batch_bodies_are_counted() -> None:
    assert request_tokens({"input": "abcdefgh", "max_output_tokens": 10}, max_model_len=None) == 2 + 10
    assert request_tokens({"input": "abcd", "instructions": "abcd", "max_output_tokens": 1}, max_model_len=None) == 3
    anthropic = {"system": "abcd", "messages": [{"role": "user", "content": "abcd"}], "max_tokens": 5}
    assert request_tokens(anthropic, max_model_len=None) == 1 + (4 + 1) + 5
    batch = {"messages": [[{"role": "user", "content": "abcd"}], [{"role": "user", "content": "abcd"}]]}
    assert request_tokens({**batch, "max_tokens": 1}, max_model_len=None) == 2 * (4 + 1) + 1


def test_retry_after_is_the_time_the_release_rate_takes_to_free_the_difference() -> None:
    now = [0.0]
    a = Admission(budget_tokens=1000, clock=lambda: now[0])
    assert a.retry_after_s(500, default=2) == 2  # nothing released yet: no rate to go by
    for _ in range(10):  # 10 requests of 100 tokens, one finishing every second
        assert a.try_reserve(100)
    for _ in range(10):
        now[0] += 1.0
        a.release(100)
        assert a.try_reserve(100)
    # 100 tokens/s released; full, so 500 more tokens wait for 500 to be freed: 5 s.
    assert a.retry_after_s(500, default=2) == 5
    assert a.retry_after_s(10, default=2) == 1  # never 0
    assert a.retry_after_s(10**9, default=2) == 60  # capped
    now[0] += 120.0  # a minute with no release: the old rate says nothing
    assert a.retry_after_s(500, default=2) == 2
    assert Admission(budget_tokens=None).retry_after_s(500, default=3) == 3
