"""Kubernetes versions the EKS target accepts: the EKS release calendar held against the day synth runs, the
versions the pinned aws-cdk-lib offers, kubectl's skew, Cluster Autoscaler images."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime
from typing import get_args

import pytest

from kvfleet.errors import ConfigError
from kvfleet.targets.eks.config import (
    EKS_CALENDAR_CHECKED,
    EKS_CALENDAR_SECONDARY,
    EKS_VERSION_CALENDAR,
    EksTarget,
    EksVersion,
    support_date,
    support_window_at,
)
from kvfleet.targets.eks.infra.addons import CLUSTER_AUTOSCALER_IMAGE_TAGS, KEDA_CHART, KEDA_TESTED_KUBERNETES
from kvfleet.targets.eks.infra.service import KUBECTL_LAYERS, KUBECTL_MINORS
from tests.infra.helpers import REPO, environment

PLATFORM = (REPO / "environments" / "platform.yaml").read_text(encoding="utf-8")
SHARED = (REPO / "environments" / "shared-cluster.yaml").read_text(encoding="utf-8")
ACCEPTED = get_args(EksVersion)


def _add_months(d: date, months: int) -> date:
    y, m = divmod(d.month - 1 + months, 12)
    return d.replace(year=d.year + y, month=m + 1)


def test_the_calendar_follows_the_eks_support_rule() -> None:
    # EKS user guide, Kubernetes version lifecycle: standard support for 14 months after the EKS release, then
    # extended support for the next 12.
    for version, (released, standard_end, extended_end) in EKS_VERSION_CALENDAR.items():
        assert _add_months(released, 14) == standard_end, version
        assert _add_months(standard_end, 12) == extended_end, version


def test_every_accepted_version_is_supported_and_has_kubectl_and_an_autoscaler() -> None:
    assert sorted(ACCEPTED) == sorted(EKS_VERSION_CALENDAR)
    for v in ACCEPTED:
        assert EKS_VERSION_CALENDAR[v][2] > EKS_CALENDAR_CHECKED, f"{v} is past EKS extended support"
        # kubectl's version-skew policy: one minor either side of the API server.
        assert abs(int(v.split(".")[1]) - int(KUBECTL_MINORS[v].split(".")[1])) <= 1, v
        # The layer named for that minor is the package of that kubectl (aws_cdk.lambda_layer_kubectl_v<minor>).
        layer = KUBECTL_LAYERS[KUBECTL_MINORS[v]]
        assert layer.__module__.startswith("aws_cdk.lambda_layer_kubectl_v" + KUBECTL_MINORS[v].split(".")[1]), v
        # Cluster Autoscaler's minor must equal the cluster's (git tags cluster-autoscaler-<tag> exist).
        assert CLUSTER_AUTOSCALER_IMAGE_TAGS[v].startswith(f"v{v}."), v


@pytest.mark.parametrize("version", ["1.33", "1.34"])
def test_a_new_cluster_on_a_version_past_standard_support_is_refused(version: str) -> None:
    text = PLATFORM.replace('kubernetes_version: "1.35"', f'kubernetes_version: "{version}"')
    with pytest.raises(ConfigError) as err, support_window_at(date(2026, 12, 7)):
        environment(text)
    [line] = err.value.lines
    assert f"deployments[0].target.kubernetes_version: EKS standard support for {version} ended" in line
    # The newest version in standard support that day: 1.36 (EKS release 2026-06-02).
    assert "create a new cluster on 1.36" in line
    version_line = text.splitlines().index(f'      kubernetes_version: "{version}"') + 1
    assert line.startswith(f"test.yaml:{version_line}:"), line


def test_an_existing_cluster_may_still_run_an_extended_support_version() -> None:
    with support_window_at(EKS_CALENDAR_CHECKED):
        environment(SHARED.replace('kubernetes_version: "1.34"', 'kubernetes_version: "1.33"'))


def test_the_window_is_the_day_synth_runs_not_a_fixed_date() -> None:
    # 1.35's standard support ends 2027-03-27: a new cluster gets it to that day, and is refused the day after.
    with support_window_at(date(2027, 3, 27)):
        environment(PLATFORM)
    with support_window_at(date(2027, 3, 28)), pytest.raises(ConfigError) as err:
        environment(PLATFORM)
    assert "EKS standard support for 1.35 ended 2027-03-27: a new cluster on it is billed" in err.value.lines[0]
    # An existing cluster may stay in extended support, to its end and not a day past it.
    text = SHARED.replace('kubernetes_version: "1.34"', 'kubernetes_version: "1.33"')
    with support_window_at(date(2027, 7, 29)):
        environment(text)
    with support_window_at(date(2027, 7, 30)), pytest.raises(ConfigError) as err:
        environment(text)
    assert "EKS extended support for 1.33 ended 2027-07-29" in err.value.lines[0]
    # A version before its EKS release is refused for a new cluster.
    with support_window_at(date(2025, 12, 1)), pytest.raises(ConfigError) as err:
        environment(PLATFORM)
    assert "EKS releases 1.35 on 2026-01-27" in err.value.lines[0]


def test_without_a_fixed_day_the_window_is_today() -> None:
    assert support_date() == datetime.now(UTC).date()
    with support_window_at(date(2030, 1, 1)):
        assert support_date() == date(2030, 1, 1)
    assert support_date() == datetime.now(UTC).date()


def test_the_default_gives_a_new_cluster_standard_support_on_the_calendars_day() -> None:
    # On the day the calendar was read the default must be in standard support; when the calendar is read again
    # (EKS_CALENDAR_CHECKED moves), the default moves with it to the newest version kvfleet covers whose dates come
    # from AWS's calendar: a row from secondary sources only (1.36) is accepted but not the default.
    default = EksTarget.model_fields["kubernetes_version"].default
    released, standard_end, _ = EKS_VERSION_CALENDAR[default]
    assert released <= EKS_CALENDAR_CHECKED <= standard_end
    primary = [v for v in ACCEPTED if v not in EKS_CALENDAR_SECONDARY]
    assert default == max(primary, key=lambda v: int(v.split(".")[1]))
    assert set(EKS_CALENDAR_SECONDARY) <= set(ACCEPTED)


def test_a_new_cluster_may_be_on_136_in_its_standard_support() -> None:
    # 1.36: EKS release 2026-06-02, standard support to 2027-08-02 (secondary sources, the 14-month rule).
    text = PLATFORM.replace('kubernetes_version: "1.35"', 'kubernetes_version: "1.36"')
    with support_window_at(date(2027, 8, 2)):
        environment(text)
    with support_window_at(date(2027, 8, 3)), pytest.raises(ConfigError) as err:
        environment(text)
    assert "EKS standard support for 1.36 ended 2027-08-02" in err.value.lines[0]
    with support_window_at(date(2026, 6, 1)), pytest.raises(ConfigError) as err:
        environment(text)
    assert "EKS releases 1.36 on 2026-06-02" in err.value.lines[0]


def _cdk_versions() -> set[str]:
    """The versions aws-cdk-lib's eks-v2 KubernetesVersion offers as constants (V1_33, ...), from the installed
    package."""
    from aws_cdk import aws_eks_v2 as eks

    return {f"1.{name.split('_')[1]}" for name in dir(eks.KubernetesVersion) if re.fullmatch(r"V1_[0-9]+", name)}


def test_every_accepted_version_is_one_the_pinned_cdk_offers() -> None:
    offered = _cdk_versions()
    assert set(ACCEPTED) <= offered, sorted(set(ACCEPTED) - offered)


def test_the_newer_versions_the_cdk_offers_are_known_gaps() -> None:
    # aws-cdk-lib 2.275.0 offers up to 1.36 and kvfleet accepts it: no gap. This fails when either side moves (a
    # newer aws-cdk-lib offering 1.37), so the list is revisited.
    newest = max(ACCEPTED, key=lambda v: int(v.split(".")[1]))
    newer = {v for v in _cdk_versions() if int(v.split(".")[1]) > int(newest.split(".")[1])}
    assert newer == set()


def test_the_versions_outside_the_pinned_kedas_tested_window_are_known_gaps() -> None:
    # KEDA 2.19 is tested on 1.32-1.34 (keda.sh, Kubernetes Compatibility): 1.35 and 1.36 run it untested. This
    # fails when the pin or the accepted versions move, so the gap is revisited (moving to 2.21 covers 1.34-1.36).
    low, high = (int(v.split(".")[1]) for v in KEDA_TESTED_KUBERNETES[KEDA_CHART.version])
    outside = {v for v in ACCEPTED if not low <= int(v.split(".")[1]) <= high}
    assert outside == {"1.35", "1.36"}
