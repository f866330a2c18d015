"""pipeline.yaml: every problem a file:line with what to change, in the pipeline file or in the environment file a
stage names; the approval default; and `kvfleet synth --pipeline` exiting 2 on a bad file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvfleet.cli import main
from kvfleet.config.pipeline import load_pipeline
from kvfleet.errors import ConfigError, KvfleetError
from tests.infra.helpers import REPO

GOOD = (REPO / "pipeline.yaml").read_text(encoding="utf-8")


def _repo(tmp_path: Path, pipeline: str = GOOD, *, envs: tuple[str, ...] = ("dev", "staging", "prod")) -> Path:
    (tmp_path / "environments").mkdir()
    for name in envs:
        shutil.copy(REPO / "environments" / f"{name}.yaml", tmp_path / "environments" / f"{name}.yaml")
    shutil.copytree(REPO / "traces", tmp_path / "traces")  # the files' workload traces, by relative path
    (tmp_path / "pipeline.yaml").write_text(pipeline, encoding="utf-8")
    return tmp_path / "pipeline.yaml"


def _problems(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_pipeline(path)
    return err.value.lines


def test_the_example_loads_with_its_stages_and_default_approval() -> None:
    loaded = load_pipeline(REPO / "pipeline.yaml")
    assert [s.environment for s in loaded.pipeline.stages] == ["dev", "staging", "prod"]
    assert [loaded.pipeline.approval_before(i) for i in range(3)] == [False, False, True]
    assert loaded.relative_paths == ("environments/dev.yaml", "environments/staging.yaml", "environments/prod.yaml")
    # Accounts come from the environment files: four distinct ones, the pipeline's own first.
    assert len({loaded.pipeline.account, *(e.environment.account for e in loaded.environments)}) == 4


def test_an_explicit_approval_replaces_the_default(tmp_path: Path) -> None:
    text = GOOD.replace("  - environment: staging\n", "  - environment: staging\n    approval: true\n")
    text = text.replace("  - environment: prod #", "  - environment: prod\n    approval: false #")
    loaded = load_pipeline(_repo(tmp_path, text))
    assert [loaded.pipeline.approval_before(i) for i in range(3)] == [False, True, False]


def test_a_stage_whose_file_names_no_account_points_at_that_file(tmp_path: Path) -> None:
    path = _repo(tmp_path)
    dev = tmp_path / "environments" / "dev.yaml"
    dev.write_text(dev.read_text().replace('account: "222222222222"\n', ""))
    [line] = _problems(path)
    assert line.startswith(f"{dev}:1: account: a pipeline deploys each stage into the account")
    assert f"{path}:13 names it" in line  # the stage's line in the pipeline file


@pytest.mark.parametrize(
    ("edit", "where", "says"),
    [
        (("  - environment: staging\n", "  - environment: stagin\n"), ":14: stages[1].environment", "no environment"),
        (("  - environment: prod #", "  - environment: dev #"), ":15: stages.2.environment", "already stage 0"),
        (
            ("connection/3f1c", "connection/XX1c"),
            ":9: source.connection_arn",
            "its description in the README (Release pipelines)",
        ),
        (("branch: main", "branch: main..x"), ":11: source.branch", "not a valid git branch name"),
        (('account: "111111111111"', "account: 111111111111"), ":5: account", "expected text; quote"),
        (("  kv_tolerance: 0.05", "  kv_tolerance: 0.05\n  bench: yes"), ":19: checks.bench", "unknown key"),
    ],
)
def test_a_bad_pipeline_file_is_one_line_each(tmp_path: Path, edit: tuple[str, str], where: str, says: str) -> None:
    assert edit[0] in GOOD
    path = _repo(tmp_path, GOOD.replace(edit[0], edit[1]))
    lines = _problems(path)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{path}{where}".replace("stages.2.environment", "stages[2].environment")), lines
    assert says in lines[0].lower() or says in lines[0]


def test_an_environment_files_own_problem_keeps_its_file_and_line(tmp_path: Path) -> None:
    path = _repo(tmp_path)
    staging = tmp_path / "environments" / "staging.yaml"
    staging.write_text(staging.read_text().replace("region: us-east-1", "region: us-middle-9"))
    [line] = _problems(path)
    assert line.startswith(f"{staging}:") and "region" in line


def test_no_pipeline_file() -> None:
    with pytest.raises(KvfleetError, match="no pipeline file at"):
        load_pipeline("nowhere/pipeline.yaml")


def test_kvfleet_synth_pipeline_exits_2_on_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _repo(tmp_path, GOOD.replace("  - environment: staging\n", "  - environment: nope\n"))
    monkeypatch.chdir(tmp_path)
    assert main(["synth", "--pipeline", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stages[1].environment: no environment file" in err[0]
