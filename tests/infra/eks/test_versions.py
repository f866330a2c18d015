"""Kubernetes versions the EKS target accepts: the EKS release calendar, kubectl's skew, Cluster Autoscaler images."""

from __future__ import annotations

from datetime import date
from typing import get_args

import pytest

from kvfleet.errors import ConfigError
from kvfleet.targets.eks.config import (
    EKS_CALENDAR_CHECKED,
    EKS_VERSION_CALENDAR,
    NEW_CLUSTER_MIN_STANDARD_SUPPORT_DAYS,
    EksTarget,
    EksVersion,
)
from kvfleet.targets.eks.infra.addons import CLUSTER_AUTOSCALER_IMAGE_TAGS
from kvfleet.targets.eks.infra.service import KUBECTL_MINOR
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
        assert abs(int(v.split(".")[1]) - int(KUBECTL_MINOR.split(".")[1])) <= 1, v
        # Cluster Autoscaler's minor must equal the cluster's (git tags cluster-autoscaler-<tag> exist).
        assert CLUSTER_AUTOSCALER_IMAGE_TAGS[v].startswith(f"v{v}."), v


def test_the_default_is_a_version_in_standard_support() -> None:
    default = EksTarget.model_fields["kubernetes_version"].default
    left = (EKS_VERSION_CALENDAR[default][1] - EKS_CALENDAR_CHECKED).days
    assert left >= NEW_CLUSTER_MIN_STANDARD_SUPPORT_DAYS, (default, left)
    # 1.33 entered extended support on 2026-07-29 and 1.34's standard support ends 2026-12-02.
    assert default == "1.35"


@pytest.mark.parametrize("version", ["1.33", "1.34"])
def test_a_new_cluster_on_a_version_leaving_standard_support_is_refused(version: str) -> None:
    text = PLATFORM.replace('kubernetes_version: "1.35"', f'kubernetes_version: "{version}"')
    with pytest.raises(ConfigError) as err:
        environment(text)
    [line] = err.value.lines
    assert f"deployments[0].target.kubernetes_version: EKS standard support for {version} ends" in line
    assert "create a new cluster on 1.35" in line
    version_line = text.splitlines().index(f'      kubernetes_version: "{version}"') + 1
    assert line.startswith(f"test.yaml:{version_line}:"), line


def test_an_existing_cluster_may_still_run_an_extended_support_version() -> None:
    environment(SHARED.replace('kubernetes_version: "1.34"', 'kubernetes_version: "1.33"'))
