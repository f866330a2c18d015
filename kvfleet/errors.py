"""User-facing errors. Each carries one line that says what is wrong, the field, and what to change.

Every layer raises these; the two edges (the ``kvfleet`` command and the CDK app) print them and exit 2.
Standard library only.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

# The exit status of both edges for an error the user can fix (argparse's for a usage error).
EXIT_USER_ERROR = 2
# The CDK CLI exits 1 whatever its app's status (aws-cdk's cli.js sets process.exitCode = 1 on any failure), so
# `kvfleet synth` names a file in this variable and the CDK app writes its exit status there.
SYNTH_STATUS_ENV = "KVFLEET_SYNTH_STATUS"


class KvfleetError(Exception):
    """Base for every error a user can cause. The CLI prints ``str(err)`` and exits 2."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        self.message = message  # without the field, so an edge can put the file and line before both
        super().__init__(f"{field}: {message}" if field else message)


class ModelConfigError(KvfleetError):
    """A model id or config.json that cannot be turned into an architecture."""


class CatalogError(KvfleetError):
    """An unknown accelerator or instance type, or a broken catalog file."""


class SizingError(KvfleetError):
    """Settings that cannot work: impossible tensor parallelism, negative lengths, no memory left."""


class NothingFitsError(SizingError):
    """The planner found no candidate; the message names the nearest one and the change that fits."""


class ConfigError(KvfleetError):
    """One or more problems in an environment file; ``lines`` holds one ``file:line: field: fix`` per problem."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        super().__init__("\n".join(lines))


class MissingExtraError(KvfleetError):
    """A command whose packages come with an install extra this installation lacks (kvfleet/extras.py raises it);
    the message names the extra to install."""


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """For a module run as a program (``python -m kvfleet.infra.<tool>``): a bad file or setting ends it with its
    one-line problems on stderr and exit status EXIT_USER_ERROR, never a traceback."""
    try:
        yield
    except ConfigError as err:
        print("\n".join(err.lines), file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except KvfleetError as err:
        print(f"kvfleet: {err}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
