"""The signals contract: one definition that the agent, scaling, alarms and dashboards share."""

from __future__ import annotations

import ast
import sys
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


def test_scaling_signals_are_saturation_and_the_queue() -> None:
    # Saturation, not raw KV use: KV use alone tops out under its target where max_num_seqs binds first.
    assert [s.name for s in contract.SCALING_SIGNALS] == ["ReplicaSaturation", "RequestsWaiting"]
    assert contract.KV_CACHE_UTILIZATION in contract.PUBLISHED_SIGNALS  # still published, and charted


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
    with pytest.raises(KeyError, match="known: ReplicaSaturation, KvCacheUtilization"):
        contract.signal("GPUUtilization")


PACKAGE = REPO / "kvfleet"


def _string_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_contract_is_standard_library_only() -> None:
    # The image copies contract.py and nothing else of the infrastructure.
    tree = ast.parse((PACKAGE / "contract.py").read_text(encoding="utf-8"))
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m.split(".")[0] for m in imported} <= set(sys.stdlib_module_names) | {"__future__"}


def test_infrastructure_does_not_spell_metric_names_itself() -> None:
    # Scaling policies, alarms and dashboards take names from the contract, never from string literals.
    for path in (PACKAGE / "infra").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for s in contract.SIGNALS:
            assert f'metric_name="{s.name}"' not in text, (path.name, s.name)
        assert f'"{contract.NAMESPACE}"' not in text, path.name


CONTRACT_VALUES = {
    v
    for k, v in vars(contract).items()
    if k.startswith("ENV_")
    or k in ("HEALTH_ROUTE", "DRAIN_ROUTE", "MODEL_DIR", "HF_HOME", "AGENT_COMMAND", "REGION_VARIABLE")
}

# Literals that predate a contract constant, in code whose owners switch it to the constant: (file, value).
# Remove an entry when its file stops spelling the value.
PENDING: frozenset[tuple[str, str]] = frozenset()


def test_contract_values_are_spelled_only_in_the_contract() -> None:
    """Every variable name, route and path the stacks and the image share is written once, in contract.py."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "contract.py":
            continue
        rel = path.relative_to(REPO).as_posix()
        for line, value in _string_literals(path):
            if value in CONTRACT_VALUES and (rel, value) not in PENDING:
                found.append(f"{rel}:{line}: {value!r}")
    assert found == []


def test_the_user_data_template_takes_shared_names_from_the_contract() -> None:
    """The shell template is not Python: its variable names arrive as rendered values, never spelled in it."""
    text = (PACKAGE / "targets" / "ec2" / "infra" / "user-data.sh").read_text(encoding="utf-8")
    for value in sorted(CONTRACT_VALUES):
        assert value not in text, value


def test_the_literal_check_finds_a_spelled_variable(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('NAME = "KVFLEET_DEPLOYMENT"\n', encoding="utf-8")
    assert [v for _, v in _string_literals(bad) if v in CONTRACT_VALUES] == ["KVFLEET_DEPLOYMENT"]


def test_env_names_are_unique_and_namespaced() -> None:
    names = [v for k, v in vars(contract).items() if k.startswith("ENV_")]
    assert len(names) == len(set(names))
    assert all(n.startswith("KVFLEET_") for n in names)


def test_image_tags_carry_the_engine_release_and_the_contract_version() -> None:
    tag = contract.image_tag("0.30.0")
    assert tag == f"0.30.0-kvfleet{contract.CONTRACT_VERSION}"
    assert contract.parse_image_tag(tag) == ("0.30.0", contract.CONTRACT_VERSION)
    assert contract.parse_image_tag("0.30.0-kvfleet7-20261201") == ("0.30.0", 7)
    assert contract.parse_image_tag("1.0.0rc1-kvfleet1") == ("1.0.0rc1", 1)
    for other in ("0.30.0", "latest", "kvfleet1", "0.30.0-kvfleet", "0.30.0-kvfleetX"):
        assert contract.parse_image_tag(other) is None, other
