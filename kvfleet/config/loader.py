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

from kvfleet.config.schema import REGION_PATTERN, Environment
from kvfleet.errors import ConfigError, KvfleetError
from kvfleet.targets import TARGETS

ENVIRONMENTS_DIR = "environments"


def environment_schema_json() -> str:
    """The JSON Schema editors use to complete and check environment files."""
    schema = Environment.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "kvfleet environment"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


# Bounds on what a file may make the loader do: environment files are a few kilobytes, a few levels deep.
MAX_FILE_BYTES = 256 * 1024
MAX_DEPTH = 64
MAX_VALUES = 500_000  # after aliases are expanded: what validation would walk
MAX_PROBLEMS = 20  # a screenful; the rest are counted


class _TooDeep(Exception):
    def __init__(self, mark: Any) -> None:
        self.mark = mark


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with a nesting limit: its composer recurses once per level."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooDeep(self.peek_event().start_mark)  # type: ignore[no-untyped-call]
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _expanded_size(root: yaml.Node, source: str) -> None:
    """Refuse self-referencing aliases and aliases that expand past MAX_VALUES (a "billion laughs" file): each
    node is visited once and its expanded size remembered, so the check costs what the file is, not what it
    would grow to."""
    size: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children: list[yaml.Node] = []
        if isinstance(node, yaml.MappingNode):
            children = [n for kv in node.value for n in kv]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        if done:
            active.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            if size[key] > MAX_VALUES:
                raise ConfigError(
                    [
                        f"{source}:{node.start_mark.line + 1}: (aliases): the aliases here expand to more than "
                        f"{MAX_VALUES:,} values; write the values out instead of nesting aliases"
                    ]
                )
            continue
        if key in size:
            continue
        if key in active:
            raise ConfigError(
                [
                    f"{source}:{node.start_mark.line + 1}: (aliases): an alias refers to the node it is inside, "
                    "so the value would contain itself; remove that alias"
                ]
            )
        active.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(children) if id(c) not in size)


def _key(node: yaml.Node) -> Any:
    return node.value if isinstance(node, yaml.ScalarNode) else f"<{node.tag.rsplit(':', 1)[-1]}>"


def _lines(
    node: yaml.Node,
    path: tuple[Any, ...],
    out: dict[tuple[Any, ...], int],
    repeated: list[tuple[tuple[Any, ...], int]],
    seen_nodes: set[int],
) -> None:
    out[path] = node.start_mark.line + 1
    if id(node) in seen_nodes:  # an aliased node: its inside is reported at the anchor's lines
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for k, v in node.value:
            key = _key(k)
            if key in seen:
                # YAML loaders keep the last one silently; a repeated key is almost always an edit gone wrong.
                repeated.append(((*path, key), k.start_mark.line + 1))
            seen.add(key)
            _lines(v, (*path, key), out, repeated, seen_nodes)
            out[(*path, key)] = k.start_mark.line + 1  # a key's own line, not its value's
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _lines(v, (*path, i), out, repeated, seen_nodes)


def _capped(lines: list[str], source: str) -> list[str]:
    if len(lines) <= MAX_PROBLEMS:
        return lines
    rest = len(lines) - MAX_PROBLEMS
    return [*lines[:MAX_PROBLEMS], f"{source}: and {rest:,} more problems; fix the ones above first"]


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
    if kind == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") == REGION_PATTERN:
        return (
            "not an AWS region; give one like us-east-1 (area af, ap, ca, cn, eu, il, me, mx, sa or us, a direction, "
            "a number)"
        )
    if kind == "int_type":
        return "expected a whole number, e.g. 4 (not true/false, a quoted string or a decimal)"
    if kind == "float_type":
        return "expected a number, e.g. 0.75 (not true/false or a quoted string)"
    if kind == "bool_type":
        return "expected true or false"
    if kind == "finite_number":
        return "expected a finite number (not .inf or .nan)"
    msg = str(err["msg"])  # pydantic's message says what is allowed (literals, bounds, types)
    return msg.removeprefix("Value error, ")


def _decode(raw: bytes, source: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            [
                f"{source}:{line}: (file): byte 0x{raw[err.start]:02x} at offset {err.start} is not UTF-8; save the "
                "file as UTF-8"
            ]
        ) from None


def _compose(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    try:
        loader = _Loader(text)
    except yaml.reader.ReaderError as err:  # a NUL or another character YAML does not allow
        line = text.count("\n", 0, err.position) + 1
        raise ConfigError(
            [f"{source}:{line}: (file): character {err.character!r} at offset {err.position} is not allowed; remove it"]
        ) from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        _expanded_size(node, source)
        return node, loader.construct_document(node)
    except _TooDeep as err:
        raise ConfigError(
            [f"{source}:{err.mark.line + 1}: (file): nested more than {MAX_DEPTH} levels deep; flatten it"]
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError([f"{source}{at}: not valid YAML: {problem}"]) from None
    except (ValueError, TypeError, OverflowError) as err:  # e.g. a timestamp like 2026-13-45
        raise ConfigError([f"{source}:1: not valid YAML: {str(err).splitlines()[0]}"]) from None
    finally:
        loader.dispose()


def parse_environment(text: str | bytes, *, source: str = "<config>") -> Environment:
    if isinstance(text, bytes):
        size = len(text)
    else:
        size = len(text) if len(text) * 4 <= MAX_FILE_BYTES else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_FILE_BYTES:
        raise ConfigError(
            [f"{source}:1: (file): {size:,} bytes; an environment file is at most {MAX_FILE_BYTES:,} bytes"]
        )
    if isinstance(text, bytes):
        text = _decode(text, source)
    node, data = _compose(text, source)
    if not isinstance(data, dict) or node is None:
        raise ConfigError([f"{source}:1: expected a mapping with 'name' and 'deployments'"])
    lines: dict[tuple[Any, ...], int] = {}
    repeated: list[tuple[tuple[Any, ...], int]] = []
    _lines(node, (), lines, repeated, set())
    if repeated:
        raise ConfigError(
            _capped(
                [
                    f"{source}:{line}: {_fmt_loc(where)}: key repeated; keep one (a loader would silently use the last)"
                    for where, line in repeated
                ],
                source,
            )
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
        raise ConfigError(_capped(out, source)) from None


def load_environment(path: str | Path) -> Environment:
    p = Path(path)
    if not p.is_file():
        hint = (
            ", ".join(sorted(x.stem for x in p.parent.glob("*.yaml") if x.stem != "schema"))
            if p.parent.is_dir()
            else ""
        )
        raise KvfleetError(f"no environment file at {p}" + (f"; found: {hint}" if hint else ""), field="environment")
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(
                [f"{path}:1: (file): {size:,} bytes; an environment file is at most {MAX_FILE_BYTES:,} bytes"]
            )
        raw = p.read_bytes()
    except OSError as err:
        raise KvfleetError(f"cannot read {p}: {err.strerror}", field="environment") from None
    return parse_environment(raw, source=str(path))


def environment_path(name: str, *, environments_dir: str | Path | None = None) -> Path:
    """``prod`` names ``<environments_dir>/prod.yaml`` (default: ``environments/`` in the working directory);
    a path to a YAML file is taken as it is."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        return p
    return Path(environments_dir if environments_dir is not None else ENVIRONMENTS_DIR) / f"{name}.yaml"
