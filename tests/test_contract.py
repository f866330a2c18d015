"""The signals contract: one definition that the agent, scaling, alarms and dashboards share."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvfleet import contract

REPO = Path(__file__).resolve().parents[1]


def test_names_are_unique_and_cloudwatch_safe() -> None:
    names = [s.name for s in contract.SIGNALS]
    assert len(names) == len(set(names))
    prom = [s.prometheus_name for s in contract.SIGNALS]
    assert len(prom) == len(set(prom))
    for s in contract.SIGNALS:
        assert s.name.isalnum() and s.name[0].isupper()
        assert s.prometheus_name.startswith("kvfleet_")
        assert s.description


def test_units_and_kinds_fit_each_other() -> None:
    for s in contract.SIGNALS:
        if s.kind is contract.Kind.DISTRIBUTION:
            assert s.unit == "Milliseconds"
            assert s.statistic.startswith("p")
        elif s.kind is contract.Kind.DELTA:
            assert (s.unit, s.statistic) == ("Count", "Sum")
        else:
            assert s.statistic == "Average"  # gauges: the per-replica mean is what target tracking needs
    assert contract.KV_CACHE_UTILIZATION.unit == "None"  # a 0-1 fraction, not Percent


def test_scaling_signals_are_the_cache_and_the_queue() -> None:
    assert [s.name for s in contract.SCALING_SIGNALS] == ["KvCacheUtilization", "RequestsWaiting"]


def test_the_issue_lists_every_signal() -> None:
    wanted = {
        "KvCacheUtilization",
        "RequestsWaiting",
        "RequestsRunning",
        "TimeToFirstToken",
        "InterTokenLatency",
        "OutputTokens",
        "Preemptions",
    }
    assert wanted <= {s.name for s in contract.SIGNALS}


def test_dimension_sets_start_with_the_deployment() -> None:
    assert all(ds[0] == contract.DEPLOYMENT_DIMENSION for ds in contract.DIMENSION_SETS)
    assert contract.deployment_id("prod", "chat") == "prod-chat"


def test_lookup_by_name() -> None:
    assert contract.signal("Preemptions") is contract.PREEMPTIONS
    with pytest.raises(KeyError, match="known: KvCacheUtilization"):
        contract.signal("GPUUtilization")


def test_contract_is_pure_python() -> None:
    # The agent imports it inside the serving image, where aws_cdk is not installed.
    tree = ast.parse((REPO / "stacks" / "contract.py").read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "dataclasses", "enum"}


def test_stacks_do_not_spell_metric_names_themselves() -> None:
    # Scaling policies, alarms and dashboards take names from the contract, never from string literals.
    for path in (REPO / "stacks").glob("*.py"):
        if path.name == "contract.py":
            continue
        text = path.read_text(encoding="utf-8")
        for s in contract.SIGNALS:
            assert f'metric_name="{s.name}"' not in text, (path.name, s.name)
        assert f'"{contract.NAMESPACE}"' not in text, path.name
