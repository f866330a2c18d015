"""`kvfleet models`: the model catalog."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvfleet.cli.args import (
    _console,
)


def add_parser(sub: Any) -> None:
    m = sub.add_parser("models", help="the model catalog")
    m.add_argument("--json", action="store_true")


def run(a: argparse.Namespace) -> int:
    from kvfleet.sizing.catalog import all_models
    from kvfleet.sizing.engines import EngineName, rope_rules
    from kvfleet.sizing.memory import kv_layout
    from kvfleet.sizing.models import context_limit
    from kvfleet.sizing.precision import KvDtype

    rows = []
    for m in all_models():
        kv = kv_layout(m, tp=1, kv_dtype=KvDtype.AUTO)
        limit = context_limit(m, rope_rules(EngineName.VLLM))  # the newest modelled vLLM's
        rows.append(
            {
                "id": m.model_id,
                "family": m.family,
                "model_type": m.model_type,
                "params_b": round(m.total_params / 1e9, 2),
                "active_params_b": round(m.active_params / 1e9, 2),
                "layers": m.num_layers,
                "kv_heads": m.num_kv_heads,
                "head_dim": m.head_dim,
                "kv_bytes_per_token": kv.kv_bytes_per_token_per_gpu,
                "max_position_embeddings": m.max_position_embeddings,
                "max_model_len_limit": limit.max_len_tokens,
                "max_model_len_source": limit.source,
                "precision": m.native_scheme.name,
                "attention": m.summary(),
                "aliases": list(m.aliases),
                "source": m.source,
            }
        )
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.table import Table

    t = Table(title=f"{len(rows)} models")
    for col in ("id", "params (B)", "active (B)", "layers", "KV heads", "KV B/token", "context", "precision"):
        t.add_column(col, justify="left" if col == "id" else "right")
    for r in rows:
        t.add_row(
            str(r["id"]),
            str(r["params_b"]),
            str(r["active_params_b"]),
            str(r["layers"]),
            str(r["kv_heads"]),
            f"{r['kv_bytes_per_token']:,}",
            f"{r['max_model_len_limit']:,}",
            str(r["precision"]),
        )
    _console().print(t)
    return 0
