"""Reading environment files: YAML with line numbers, so every problem is ``file:line: field.path: what to change``.

``environments/`` is found from the working directory (or the directory given), so an installed kvfleet
works outside a checkout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvfleet.config.schema import Environment
from kvfleet.errors import ConfigError, KvfleetError
from kvfleet.targets import TARGETS

ENVIRONMENTS_DIR = "environments"


def environment_schema_json() -> str:
    """The JSON Schema editors use to complete and check environment files."""
    schema = Environment.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "kvfleet environment"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def _lines(
    node: yaml.Node, path: tuple[Any, ...], out: dict[tuple[Any, ...], int], repeated: list[tuple[tuple[Any, ...], int]]
) -> None:
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for k, v in node.value:
            if k.value in seen:
                # YAML loaders keep the last one silently; a repeated key is almost always an edit gone wrong.
                repeated.append(((*path, k.value), k.start_mark.line + 1))
            seen.add(k.value)
            _lines(v, (*path, k.value), out, repeated)
            out[(*path, k.value)] = k.start_mark.line + 1  # a key's own line, not its value's
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _lines(v, (*path, i), out, repeated)


def _fmt_loc(loc: tuple[Any, ...]) -> str:
    s = ""
    for part in loc:
        s += f"[{part}]" if isinstance(part, int) else (f".{part}" if s else str(part))
    return s or "(top level)"


def _allowed(err: Any) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown key; remove it or check its spelling"
    if kind == "missing":
        return "required field is missing"
    msg = str(err["msg"])  # pydantic's message says what is allowed (literals, bounds, types)
    return msg.removeprefix("Value error, ")


def parse_environment(text: str, *, source: str = "<config>") -> Environment:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError([f"{source}{line}: not valid YAML: {problem}"]) from None
    if not isinstance(data, dict) or node is None:
        raise ConfigError([f"{source}:1: expected a mapping with 'name' and 'deployments'"])
    lines: dict[tuple[Any, ...], int] = {}
    repeated: list[tuple[tuple[Any, ...], int]] = []
    _lines(node, (), lines, repeated)
    if repeated:
        raise ConfigError(
            [
                f"{source}:{line}: {_fmt_loc(where)}: key repeated; keep one (a loader would silently use the last)"
                for where, line in repeated
            ]
        )
    try:
        return Environment.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        deeper = {tuple(e["loc"][:-1]) for e in errors if len(e["loc"]) > 1}
        deeper |= {tuple(e["loc"][:i]) for e in errors for i in range(1, len(e["loc"]))}
        out = []
        for problem in errors:
            # pydantic re-checks min_length on the items that validated; that echo is noise when the
            # real problem sits inside one of the items.
            if problem["type"] == "too_short" and tuple(problem["loc"]) in deeper:
                continue
            loc = tuple(p for p in problem["loc"] if not (isinstance(p, str) and p in TARGETS))
            for problem_text in _allowed(problem).split("\n"):
                where, msg = loc, problem_text
                # A cross-field check names the field to change first: "scaling.min_replicas: ...".
                m = (
                    re.match(r"^([a-z][a-z0-9_]*(?:\.(?:[a-z][a-z0-9_]*|\d+))*): (.*)$", problem_text)
                    if problem["type"] == "value_error"
                    else None
                )
                if m:
                    where = (*loc, *(int(part) if part.isdigit() else part for part in m[1].split(".")))
                    msg = m[2]
                line_no = next((lines[where[:i]] for i in range(len(where), -1, -1) if where[:i] in lines), 1)
                out.append(f"{source}:{line_no}: {_fmt_loc(where)}: {msg}")
        raise ConfigError(out) from None


def load_environment(path: str | Path) -> Environment:
    p = Path(path)
    if not p.is_file():
        hint = (
            ", ".join(sorted(x.stem for x in p.parent.glob("*.yaml") if x.stem != "schema"))
            if p.parent.is_dir()
            else ""
        )
        raise KvfleetError(f"no environment file at {p}" + (f"; found: {hint}" if hint else ""), field="environment")
    return parse_environment(p.read_text(encoding="utf-8"), source=str(path))


def environment_path(name: str, *, environments_dir: str | Path | None = None) -> Path:
    """``prod`` names ``<environments_dir>/prod.yaml`` (default: ``environments/`` in the working directory);
    a path to a YAML file is taken as it is."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        return p
    return Path(environments_dir if environments_dir is not None else ENVIRONMENTS_DIR) / f"{name}.yaml"
