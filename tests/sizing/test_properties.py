"""Properties that hold for any architecture and any memory size (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.sizing.capacity import EngineSettings, capacity
from kvfleet.sizing.memory import kv_layout
from kvfleet.sizing.precision import KvDtype
from kvfleet.sizing.units import GiB
from tests.sizing.conftest import make_model

layers = st.integers(min_value=1, max_value=96)
kv_heads = st.sampled_from([1, 2, 4, 8, 16])
head_dims = st.sampled_from([64, 80, 96, 128, 256])
mems = st.floats(min_value=16, max_value=200)


def _model(n_layers: int, n_kv: int, head_dim: int, window: int | None = None):  # type: ignore[no-untyped-def]
    extra = {"model_type": "mistral", "sliding_window": window} if window else {}
    return make_model(
        num_hidden_layers=n_layers,
        num_attention_heads=32,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        hidden_size=2048,
        intermediate_size=5632,
        vocab_size=32000,
        **extra,
    )


@settings(max_examples=60, deadline=None)
@given(n=layers, kv=kv_heads, d=head_dims, a=mems, b=mems)
def test_capacity_grows_with_memory(n: int, kv: int, d: int, a: float, b: float) -> None:
    m = _model(n, kv, d)
    lo, hi = sorted((a, b))
    s = EngineSettings(max_model_len=4096, gpu_memory_utilization=0.9)
    small = capacity(m, gpu_memory_bytes=int(lo * GiB), settings=s)
    large = capacity(m, gpu_memory_bytes=int(hi * GiB), settings=s)
    assert large.kv_cache_tokens >= small.kv_cache_tokens
    assert large.max_concurrency >= small.max_concurrency


@settings(max_examples=60, deadline=None)
@given(n=layers, kv=kv_heads, d=head_dims, gib=st.integers(min_value=1, max_value=64))
def test_fp8_kv_holds_twice_the_tokens(n: int, kv: int, d: int, gib: int) -> None:
    m = _model(n, kv, d)
    s = EngineSettings(max_model_len=4096, kv_cache_memory_bytes=gib * GiB)
    bf16 = capacity(m, gpu_memory_bytes=80 * GiB, settings=s)
    fp8 = capacity(
        m, gpu_memory_bytes=80 * GiB, settings=EngineSettings(**{**s.__dict__, "kv_cache_dtype": KvDtype.FP8})
    )
    assert fp8.kv_bytes_per_token_per_gpu * 2 == bf16.kv_bytes_per_token_per_gpu
    # Whole blocks on both sides: at most one block of rounding.
    assert 2 * bf16.kv_cache_tokens <= fp8.kv_cache_tokens <= 2 * bf16.kv_cache_tokens + bf16.block_size


@settings(max_examples=60, deadline=None)
@given(n=layers, kv=kv_heads, d=head_dims, tp=st.sampled_from([1, 2, 4, 8, 16, 32]))
def test_kv_heads_shard_then_replicate(n: int, kv: int, d: int, tp: int) -> None:
    m = _model(n, kv, d)
    one = kv_layout(m, tp=1, kv_dtype=KvDtype.AUTO).kv_bytes_per_token_per_gpu
    per_rank = kv_layout(m, tp=tp, kv_dtype=KvDtype.AUTO).kv_bytes_per_token_per_gpu
    if tp <= kv:
        assert per_rank * tp == one  # split evenly
    else:
        assert per_rank == one // kv  # one replicated head per rank
    assert per_rank == 2 * n * max(1, kv // tp) * d * 2


@settings(max_examples=60, deadline=None)
@given(n=layers, kv=kv_heads, d=head_dims, window=st.integers(min_value=16, max_value=8192), seq=st.integers(1, 65536))
def test_sliding_window_caps_a_sequence(n: int, kv: int, d: int, window: int, seq: int) -> None:
    m = _model(n, kv, d, window=window)
    layout = kv_layout(m, tp=1, kv_dtype=KvDtype.AUTO)
    per_token = layout.kv_bytes_per_token_per_gpu
    assert layout.bytes_per_sequence(seq) == min(seq, window) * per_token
    assert layout.bytes_per_sequence(seq) <= window * per_token


@settings(max_examples=40, deadline=None)
@given(n=layers, kv=kv_heads, d=head_dims, l1=st.integers(512, 32768), l2=st.integers(512, 32768))
def test_concurrency_falls_as_sequences_grow(n: int, kv: int, d: int, l1: int, l2: int) -> None:
    m = _model(n, kv, d)
    short, long_ = sorted((l1, l2))
    s = EngineSettings(kv_cache_memory_bytes=8 * GiB)
    a = capacity(m, gpu_memory_bytes=80 * GiB, settings=EngineSettings(**{**s.__dict__, "max_model_len": short}))
    b = capacity(m, gpu_memory_bytes=80 * GiB, settings=EngineSettings(**{**s.__dict__, "max_model_len": long_}))
    assert b.max_concurrency <= a.max_concurrency
