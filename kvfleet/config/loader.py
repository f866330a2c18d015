"""Reading environment files: YAML with line numbers, so every problem is ``file:line: field.path: what to change``.

``environments/`` is found from the working directory (or the directory given), so an installed kvfleet
works outside a checkout. A deployment's ``workload.trace`` is read here, once, relative to the file's directory:
the values it implies fill what the workload leaves out before the file is validated, so everything after the
loader receives plain numbers. So is the lock beside the file (``kvfleet.config.host_lock``): the host images it
pins travel with the loaded file to every edge that deploys it (``kvfleet synth``, the app, a pipeline's stages).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from kvfleet.config.choices import UndecidedError
from kvfleet.config.host_lock import LockError, PinnedImage, lock_path, read_lock
from kvfleet.config.schema import REGION_PATTERN, TRACE_MAX_PERCENTILE, Environment, WorkloadTrace
from kvfleet.config.targets import target_sections
from kvfleet.errors import ConfigError, KvfleetError
from kvfleet.targets import TARGETS
from kvfleet.workload.profile import WorkloadProfile, profile
from kvfleet.workload.traces import Trace, TraceError, read_trace

ENVIRONMENTS_DIR = "environments"
_M = TypeVar("_M", bound=BaseModel)


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


def _line(lines: Mapping[tuple[Any, ...], int], where: tuple[Any, ...]) -> int:
    """The line of the longest prefix of ``where`` the file has (a YAML key 1 is the text "1" there)."""
    for i in range(len(where), -1, -1):
        for key in (where[:i], tuple(str(p) if isinstance(p, int) else p for p in where[:i])):
            if key in lines:
                return lines[key]
    return 1


def parse_field(field: str) -> tuple[str | int, ...]:
    """``deployments[0].engine.version`` (or ``deployments.0.engine``) as a key path."""
    out: list[str | int] = []
    for part in re.findall(r"[^.\[\]]+", field):
        out.append(int(part) if part.isdigit() else part)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class LoadedEnvironment:
    """A parsed file and the line of each key path in it: what the edges need to put ``file:line`` before an
    error found after loading (the plan, synth)."""

    environment: Environment
    source: str
    lines: Mapping[tuple[Any, ...], int] = field(default_factory=dict)
    # Each deployment's workload.trace as read when the file was loaded (window and rate scale applied), by its
    # index in ``deployments``: what ``kvfleet simulate`` replays, without reading the file again.
    traces: Mapping[int, Trace] = field(default_factory=dict)
    # The workload keys each of those traces gave (those the file left out), so an error about one names the trace.
    from_trace: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    # The host images the lock beside the file pins (none without a lock, or for a file given as text).
    host_images: tuple[PinnedImage, ...] = ()

    def line(self, field: str) -> int:
        return _line(self.lines, parse_field(field))

    def problem(self, err: KvfleetError) -> ConfigError:
        """``err`` as ``file:line: field: what to change``; an error naming no field points at the file."""
        if isinstance(err, ConfigError):
            return err
        if isinstance(err, UndecidedError):  # several choices, each at its own line
            return ConfigError([self.problem(KvfleetError(u.message, field=u.field)).lines[0] for u in err.problems])
        if err.field is None:
            return ConfigError([f"{self.source}:1: {err.message}"])
        path = parse_field(err.field)
        if path[0] not in Environment.model_fields:  # not a key of the file (e.g. "environment")
            return ConfigError([f"{self.source}:1: {err.field}: {err.message}"])
        line, message = _line(self.lines, path), err.message
        if (
            len(path) >= 4
            and path[0] == "deployments"
            and isinstance(path[1], int)
            and path[2] == "workload"
            and path[3] in self.from_trace.get(path[1], ())
        ):
            # A value the file does not hold: the trace gave it, so point there and say how to override it.
            line = _line(self.lines, (*path[:3], "trace", "path"))
            message += f" (workload.{path[3]} comes from workload.trace; type it in the workload to set it)"
        return ConfigError([f"{self.source}:{line}: {_fmt_loc(path)}: {message}"])


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


# What each pattern-checked field takes, in words: a message never quotes the regular expression.
_PATTERN_WORDS: dict[str, str] = {
    REGION_PATTERN: (
        "not an AWS region; give one like us-east-1 (area af, ap, ca, cn, eu, il, me, mx, sa or us, a direction, "
        "a number)"
    ),
}
# The targets' own fields say theirs in their sections (TargetSection.pattern_words).
_PATTERN_FIELDS: dict[str, str] = {
    "name": "lowercase letters, digits and '-' (not first or last)",
    "account": "a 12-digit AWS account id",
    "vpc_id": "a VPC id like vpc-0123456789abcdef0",
    "repository": "an ECR repository name: lowercase letters and digits, separated by '.', '_', '-' or '/'",
    "tag": "an image tag: letters, digits, '_', '.', '-' (not first), at most 128 characters",
    "uri": "an ECR image URI like 123456789012.dkr.ecr.us-east-1.amazonaws.com/kvfleet-vllm:TAG",
    "topic_arn": "an SNS topic ARN like arn:aws:sns:us-east-1:123456789012:alerts",
}


# Keys an earlier release took, with what replaces them.
_RENAMED = {
    "kv_cache_utilization_target": (
        "renamed to saturation_target, which scales on the larger of KV-cache use and running sequences over "
        "max_num_seqs (KV use alone may never reach its target)"
    ),
}


# pydantic error types whose sentence needs nothing from the error.
_PLAIN = {
    "int_type": "expected a whole number, e.g. 4 (not true/false, a quoted string or a decimal)",
    "float_type": "expected a number, e.g. 0.75 (not true/false or a quoted string)",
    "bool_type": "expected true or false",
    "finite_number": "expected a finite number (not .inf or .nan)",
    "string_type": "expected text; quote a value that YAML would read as a number, date, true/false or null",
    "tuple_type": "expected a list, e.g. [a, b] or one '- item' per line",
    "list_type": "expected a list, e.g. [a, b] or one '- item' per line",
    "model_type": "expected a mapping: 'key: value' lines indented below this key",
    "model_attributes_type": "expected a mapping: 'key: value' lines indented below this key",
    "dict_type": "expected a mapping: 'key: value' lines indented below this key",
    "dict_keys": "keys must be text",
}
_BOUND_WORDS = {"greater_than": "greater than", "greater_than_equal": "at least", "less_than": "less than"}


def _allowed(err: Any) -> str:
    """One plain sentence per pydantic error type that a file can cause: no regular expressions, no pydantic
    type words (tuple, dictionary, instance of)."""
    kind = err["type"]
    ctx = err.get("ctx", {})
    field = next((p for p in reversed(err["loc"]) if isinstance(p, str)), "")
    if kind in _PLAIN:
        return _PLAIN[kind]
    if kind == "extra_forbidden":
        return _RENAMED.get(field, "unknown key; remove it or check its spelling")
    if kind == "missing":
        if field in ("max_input_tokens", "max_output_tokens"):
            return "required field is missing; give it, or a workload.trace to read it from"
        return "required field is missing"
    if kind == "string_pattern_mismatch":
        return _pattern_words(str(ctx.get("pattern", "")), field)
    if kind in _SIZED:
        return _SIZED[kind](ctx)
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bound = next(v for k, v in ctx.items() if k in ("gt", "ge", "lt", "le"))
        return f"must be {_BOUND_WORDS.get(kind, 'at most')} {bound}"
    if "Keys should be strings" in str(err.get("msg", "")):
        return "keys must be text"
    msg = str(err["msg"]).removeprefix("Value error, ")  # ours, and anything pydantic adds later
    return "expected " + msg.removeprefix("Input should be ") if msg.startswith("Input should be ") else msg


def _pattern_words(pattern: str, field: str) -> str:
    if pattern in _PATTERN_WORDS:
        return _PATTERN_WORDS[pattern]
    form = _PATTERN_FIELDS.get(field) or next(
        (s.pattern_words[field] for s in target_sections() if field in s.pattern_words), None
    )
    return f"expected {form}" if form else "not in the form this field takes; see its description in schema.json"


def _at_least(ctx: dict[str, Any]) -> str:
    n = ctx.get("min_length", 1)
    return f"give at least {n} {'entry' if n == 1 else 'entries'}"


# pydantic error types whose sentence reads the error's context: lengths, the target tag, the literal's values.
_SIZED: dict[str, Callable[[dict[str, Any]], str]] = {
    "too_short": _at_least,
    "too_long": lambda ctx: f"at most {ctx.get('max_length')} entries; this has {ctx.get('actual_length')}",
    "string_too_short": lambda ctx: f"at least {ctx.get('min_length')} characters",
    "string_too_long": lambda ctx: f"at most {ctx.get('max_length')} characters",
    "union_tag_invalid": lambda ctx: f"platform {ctx.get('tag')!r} is not a target; use one of: {', '.join(TARGETS)}",
    "union_tag_not_found": lambda ctx: f"needs `platform`, one of: {', '.join(TARGETS)}",
    "literal_error": lambda ctx: f"use {ctx.get('expected')}",
}


def _yaml_problem(err: yaml.YAMLError) -> tuple[int | None, str]:
    """PyYAML's error as a line and a sentence, without its token names (``<block end>``, ``'?'``)."""
    problem = str(getattr(err, "problem", None) or str(err).splitlines()[0])
    context = str(getattr(err, "context", None) or "")
    mark, opened = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
    line = None if mark is None else mark.line + 1
    start = None if opened is None else opened.line + 1
    if "quoted scalar" in context and start is not None:
        # The scanner reads on to the end of the file looking for the closing quote: the fix is where it opened.
        return start, "a quoted value starts here and its closing quote is missing; close the quote on this line"
    if "flow sequence" in context or "flow mapping" in context:
        close = "]" if "sequence" in context else "}"
        where = f" on line {start}" if start is not None else ""
        return line, (
            f"the {'[' if close == ']' else '{'} opened{where} is not closed before this; add {close!r} after the "
            "last item, or separate items with ', '"
        )
    if "block" in context or "<block" in problem or "expected <" in problem:
        return line, "the indentation here does not line up with the keys above; indent with spaces to match"
    if m := re.match(r"found character '(.*)' that cannot start any token", problem):
        if m[1] == "\\t":
            return line, "a tab character; indent with spaces"
        return line, f"a value cannot start with {m[1]!r}; put the value in quotes"
    if problem.startswith("mapping values are not allowed"):
        return line, "a ': ' inside a value; put the value in quotes, or start the key on a new line"
    if m := re.match(r"found undefined alias '(.*)'", problem):
        return line, f"*{m[1]} names no anchor (&{m[1]}) defined above it; define the anchor first or write the value"
    if m := re.match(r"could not determine a constructor for the tag '(.*)'", problem):
        return line, f"the tag {m[1].removeprefix('tag:yaml.org,2002:')} is not allowed; remove it (plain values only)"
    if "found unexpected end of stream" in problem:
        return line, "the file ends in the middle of a value; complete or remove the last lines"
    # Anything else: PyYAML's own sentence, with its token names in words.
    words = re.sub(r"<(block|flow) (\w+)( \w+)?>", lambda m: f"the {m[0][1:-1]}", problem)
    return line, words


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
        yaml_line, problem = _yaml_problem(err)
        at = f":{yaml_line}" if yaml_line is not None else ""
        raise ConfigError([f"{source}{at}: not valid YAML: {problem}"]) from None
    except (ValueError, TypeError, OverflowError) as err:  # e.g. a timestamp like 2026-13-45
        raise ConfigError([f"{source}:1: not valid YAML: {str(err).splitlines()[0]}"]) from None
    finally:
        loader.dispose()


def parse_environment(
    text: str | bytes, *, source: str = "<config>", directory: str | Path | None = None
) -> Environment:
    return parse_located(text, source=source, directory=directory).environment


def parse_located(
    text: str | bytes, *, source: str = "<config>", directory: str | Path | None = None
) -> LoadedEnvironment:
    """The environment with the line of every key path, so later errors (planning, synth) can name the line.

    ``directory`` is what a ``workload.trace`` path is relative to: the file's own directory (default: the
    working directory)."""
    data, lines = read_document(text, source=source, expected="a mapping with 'name' and 'deployments'")
    data, traces, from_trace = _with_traces(data, lines, source, Path(directory) if directory is not None else Path())
    try:
        env = Environment.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_capped(_validation_problems(exc, lines, source), source)) from None
    return LoadedEnvironment(environment=env, source=source, lines=lines, traces=traces, from_trace=from_trace)


def read_document(
    text: str | bytes, *, source: str, expected: str, kind: str = "an environment file"
) -> tuple[dict[str, Any], dict[tuple[Any, ...], int]]:
    """A YAML mapping of one of kvfleet's files (bounded in size, depth and alias expansion, repeated keys refused)
    and the line of every key path in it; ``expected`` says in words what the top of the file should be."""
    if isinstance(text, bytes):
        size = len(text)
    else:
        size = len(text) if len(text) * 4 <= MAX_FILE_BYTES else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_FILE_BYTES:
        raise ConfigError([f"{source}:1: (file): {size:,} bytes; {kind} is at most {MAX_FILE_BYTES:,} bytes"])
    if isinstance(text, bytes):
        text = _decode(text, source)
    node, data = _compose(text, source)
    if not isinstance(data, dict) or node is None:
        raise ConfigError([f"{source}:1: expected {expected}"])
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
    return data, lines


def validate_document(
    model: type[_M],
    data: Mapping[str, Any],
    lines: Mapping[tuple[Any, ...], int],
    source: str,
    *,
    described_in: str = "schema.json",
) -> _M:
    """``data`` as ``model``, or every problem as ``file:line: key.path: what to change`` (at most a screenful);
    ``described_in`` is where a user reads what a field takes."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = _validation_problems(exc, lines, source)
        if described_in != "schema.json":
            problems = [
                p.replace("its description in schema.json", f"its description in {described_in}") for p in problems
            ]
        raise ConfigError(_capped(problems, source)) from None


def _validation_problems(
    exc: ValidationError, lines: Mapping[tuple[Any, ...], int], source: str, *, within: tuple[Any, ...] = ()
) -> list[str]:
    """One ``file:line: key.path: what to change`` per problem pydantic found in the value at ``within``."""
    errors = exc.errors()
    deeper = {tuple(e["loc"][:-1]) for e in errors if len(e["loc"]) > 1}
    deeper |= {tuple(e["loc"][:i]) for e in errors for i in range(1, len(e["loc"]))}
    out = []
    for problem in errors:
        # pydantic re-checks min_length on the items that validated; that echo is noise when the
        # real problem sits inside one of the items.
        if problem["type"] == "too_short" and tuple(problem["loc"]) in deeper:
            continue
        loc = (*within, *(p for p in problem["loc"] if not (isinstance(p, str) and p in TARGETS)))
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
            out.append(f"{source}:{_line(lines, where)}: {_fmt_loc(where)}: {msg}")
    return out


def trace_workload(p: WorkloadProfile, given: Mapping[str, Any]) -> dict[str, int | float]:
    """The workload values a trace's profile implies, for the keys ``given`` (the file's workload) leaves out.

    Means for the averages, the TRACE_MAX_PERCENTILE for the maxima, the busiest minute for the peak rate (the
    mean rate when the window is under a minute, whose busiest minute is only part of one). A mean above the
    maximum it goes with (typed or implied) is capped at it."""
    pct = TRACE_MAX_PERCENTILE
    a = p.arrivals
    implied: dict[str, int | float] = {
        "max_input_tokens": max(1, getattr(p.input_tokens, pct)),
        "max_output_tokens": max(1, getattr(p.output_tokens, pct)),
        "avg_input_tokens": max(1, round(p.input_tokens.mean)),
        "avg_output_tokens": max(1, round(p.output_tokens.mean)),
        "peak_requests_per_s": round(a.peak_per_minute / 60 if p.duration_s >= 60 else a.mean_per_s, 3),
    }
    out = {k: v for k, v in implied.items() if given.get(k) is None}
    for avg, longest in (("avg_input_tokens", "max_input_tokens"), ("avg_output_tokens", "max_output_tokens")):
        typed = given.get(longest)
        cap = out.get(longest) if typed is None else typed
        # A typed maximum that is not a whole number is reported by validation; the mean is then left alone.
        if avg in out and isinstance(cap, int) and not isinstance(cap, bool) and cap > 0:
            out[avg] = min(out[avg], cap)
    return out


def _with_traces(
    data: dict[Any, Any], lines: Mapping[tuple[Any, ...], int], source: str, directory: Path
) -> tuple[dict[Any, Any], dict[int, Trace], dict[int, tuple[str, ...]]]:
    """``data`` with each deployment's workload filled from its ``workload.trace``, the traces read, and the keys
    each one filled.

    The file's own mappings are copied, never changed: a YAML alias can share one mapping between deployments.
    A trace that cannot be read is one line at its ``path``; anything else is left to validation."""
    deployments = data.get("deployments")
    if not isinstance(deployments, list):
        return data, {}, {}
    traces: dict[int, Trace] = {}
    from_trace: dict[int, tuple[str, ...]] = {}
    read: dict[tuple[Any, ...], Trace] = {}  # deployments naming the same trace and window read it once
    filled: list[Any] = []
    for i, d in enumerate(deployments):
        w = d.get("workload") if isinstance(d, dict) else None
        if not isinstance(w, dict) or w.get("trace") is None:
            filled.append(d)
            continue
        within = ("deployments", i, "workload", "trace")
        try:
            spec = WorkloadTrace.model_validate(w["trace"])
        except ValidationError as exc:
            raise ConfigError(_capped(_validation_problems(exc, lines, source, within=within), source)) from None
        named = Path(spec.path)
        path = named if named.is_absolute() else directory / named
        key = (str(path), spec.format, spec.start_s, spec.duration_s, spec.rate_scale)
        if key not in read:
            read[key] = _read_trace(spec, path, within=within, lines=lines, source=source, directory=directory)
        traces[i] = read[key]
        implied = trace_workload(profile(traces[i]), w)
        from_trace[i] = tuple(implied)
        filled.append({**d, "workload": {**w, **implied}})
    return {**data, "deployments": filled}, traces, from_trace


def _read_trace(
    spec: WorkloadTrace,
    path: Path,
    *,
    within: tuple[Any, ...],
    lines: Mapping[tuple[Any, ...], int],
    source: str,
    directory: Path,
) -> Trace:
    def problem(key: str, message: str) -> ConfigError:
        where = (*within, key)
        text = " ".join(message.split())  # one line, whatever the trace's own error says
        return ConfigError([f"{source}:{_line(lines, where)}: {_fmt_loc(where)}: {text}"])

    if not path.is_file():
        base = "the working directory" if str(directory) == "." else f"this file's directory ({directory})"
        raise problem("path", f"no trace file at {path}; give the path of a trace file relative to {base}")
    try:
        return read_trace(
            path, fmt=spec.format, start_s=spec.start_s, duration_s=spec.duration_s, rate_scale=spec.rate_scale
        )
    except TraceError as err:
        if ": (window): " in err.message:  # the window is what to change, not the trace
            key = next((k for k in ("duration_s", "start_s") if (*within, k) in lines), "path")
            fix = "set start_s and duration_s to a part of the trace that has requests"
            raise problem(key, f"{err.message}; {fix}") from None
        # The trace's own errors say what to change in it; one that does not (an unreadable file) gets a fix.
        fix = "" if ";" in err.message else "; make the file readable or name another trace"
        raise problem("path", f"{err.message}{fix}") from None


def load_environment(path: str | Path) -> Environment:
    return load_located(path).environment


def load_located(path: str | Path) -> LoadedEnvironment:
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
    loaded = parse_located(raw, source=str(path), directory=p.parent)
    try:
        images = read_lock(lock_path(p))
    except LockError as err:  # already one line naming the lock and the field
        raise ConfigError([str(err)]) from None
    return replace(loaded, host_images=images)


def environment_path(name: str, *, environments_dir: str | Path | None = None) -> Path:
    """``prod`` names ``<environments_dir>/prod.yaml`` (default: ``environments/`` in the working directory);
    a path to a YAML file is taken as it is."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        return p
    return Path(environments_dir if environments_dir is not None else ENVIRONMENTS_DIR) / f"{name}.yaml"
