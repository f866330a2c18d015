"""Regenerate docs/environment-reference.md: every section and field of an environment file, with its type, default,
allowed values and description, from the models kvfleet validates files with (kvfleet/config/schema.py and each
target's kvfleet/targets/<name>/config.py; `kvfleet schema` prints the same schema as JSON Schema).

    .venv/bin/python tools/env_reference.py          # write docs/environment-reference.md
    .venv/bin/python tools/env_reference.py --check  # exit 1 when docs/environment-reference.md is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's kvfleet, not another one installed

DOC = REPO / "docs" / "environment-reference.md"

Schema = dict[str, Any]


@dataclass
class Section:
    """One mapping of the file (the top level, a deployment, its scaling, one target platform), at its key path."""

    path: str  # how the file spells it: deployments[].scaling
    heading: str  # the Markdown heading's text
    schema: Schema
    description: str
    depth: int
    children: list[Section] = field(default_factory=list)


def environment_schema() -> Schema:
    """The JSON Schema of environment files, as pydantic gives it (fields in the models' order)."""
    from kvfleet.config.schema import Environment

    return Environment.model_json_schema()


def target_summaries() -> dict[str, str]:
    """Each target platform's one-line summary from the target registry, where it has one."""
    try:
        from kvfleet.targets import TARGETS
    except ImportError:  # the registry moved: the reference still renders, without the summaries
        return {}
    return {name: str(getattr(t, "summary", "")) for name, t in TARGETS.items()}


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def code(text: str) -> str:
    """``text`` as one Markdown code span, whatever backticks it holds."""
    run = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * (run + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or run else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def prose(text: str) -> str:
    """A description as Markdown: single line breaks joined, paragraphs kept, and outside code spans the characters
    Markdown would read as markup (``<engine>`` as an HTML tag, ``ml.*`` as emphasis) escaped."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    out = []
    for p in paragraphs:
        parts = re.split(r"(`[^`]*`)", p)
        out.append("".join(s if s.startswith("`") else re.sub(r"([\\<>*])", r"\\\1", s) for s in parts))
    return "\n\n".join(out)


def _ref(schema: Schema, defs: Schema) -> Schema | None:
    ref = schema.get("$ref")
    return defs[ref.rsplit("/", 1)[-1]] if isinstance(ref, str) else None


def _nullable(schema: Schema) -> tuple[Schema, bool]:
    """The schema without its ``null`` alternative, and whether it had one."""
    options = schema.get("anyOf")
    if isinstance(options, list):
        rest = [o for o in options if o.get("type") != "null"]
        if len(rest) < len(options):
            inner = rest[0] if len(rest) == 1 else {"anyOf": rest}
            return inner, True
    return schema, False


def _or_words(schema: Schema) -> tuple[Schema, list[Any]]:
    """A section that may also be written as a word (``notifications: none``): the section's schema and the words;
    any other schema as it is, with none."""
    options = schema.get("anyOf")
    if isinstance(options, list):
        refs = [o for o in options if "$ref" in o]
        words = [o["const"] for o in options if "const" in o]
        if len(refs) == 1 and len(refs) + len(words) == len(options):
            return refs[0], words
    return schema, []


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() and abs(value) >= 1000 else str(value)


def _bounds(schema: Schema) -> str:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if lo is not None and hi is not None:
        return f"from {_number(lo)} to {_number(hi)}"
    parts = []
    if lo is not None:
        parts.append(f"at least {_number(lo)}")
    if (x := schema.get("exclusiveMinimum")) is not None:
        parts.append(f"above {_number(x)}")
    if hi is not None:
        parts.append(f"at most {_number(hi)}")
    if (x := schema.get("exclusiveMaximum")) is not None:
        parts.append(f"below {_number(x)}")
    return " and ".join(parts)


def _scalar(schema: Schema) -> str:
    """A value's type and what it may be, in words."""
    if "const" in schema:
        return code(str(schema["const"]))
    if "enum" in schema:
        return "one of " + ", ".join(code(str(v)) for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items", {})
        text = f"list of {_plural(_scalar(items))}" if items else "list"
        lo, hi = schema.get("minItems"), schema.get("maxItems")
        if lo is not None and hi is not None:
            text += f", {lo} to {hi} items"
        elif lo is not None:
            text += f", at least {lo} item{'s' if lo != 1 else ''}"
        elif hi is not None:
            text += f", at most {hi} items"
        return text
    if "anyOf" in schema:
        return " or ".join(_scalar(o) for o in schema["anyOf"])
    text = {"string": "text", "integer": "integer", "number": "number", "boolean": "true or false"}.get(
        str(kind), str(kind)
    )
    if bounds := _bounds(schema):
        text += f" {bounds}"
    if pattern := schema.get("pattern"):
        text += f" matching {code(pattern)}"
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if (lo is not None and lo > 1) or hi is not None:
        text += f", {lo or 0} to {hi} characters" if hi is not None else f", at least {lo} characters"
    elif lo == 1:
        text += ", not empty"
    if examples := schema.get("examples"):
        text += ", e.g. " + ", ".join(code(str(e)) for e in examples)
    return text


def _plural(text: str) -> str:
    if text.startswith("one of "):
        return "values, each " + text
    for word in ("text", "integer", "number"):
        if text.startswith(word):
            return {"text": "text values", "integer": "integers", "number": "numbers"}[word] + text[len(word) :]
    return text


def _default(value: Any) -> str:
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return code("true" if value else "false")
    if isinstance(value, list | dict):
        return code(json.dumps(value))
    return code(str(value))


def _section_ref(section: Section, text: str | None = None) -> str:
    return f"[{text or code(section.path)}](#{anchor(section.heading)})"


def build(schema: Schema) -> Section:
    """The sections of the file, nested as the YAML nests them."""
    defs = schema.get("$defs", {})
    summaries = target_summaries()
    root = Section(
        path="(top level)",
        heading="Top level",
        schema=schema,
        description="The file itself: one environment.",
        depth=0,
    )

    def walk(section: Section) -> None:
        for name, prop in section.schema.get("properties", {}).items():
            key = name if section.depth == 0 else f"{section.path}.{name}"
            inner, _ = _or_words(_nullable(prop)[0])
            if (target := _ref(inner, defs)) is not None:
                child = Section(
                    path=key,
                    heading=code(key),
                    schema=target,
                    description=target.get("description") or prop.get("description", ""),
                    depth=section.depth + 1,
                )
                section.children.append(child)
                walk(child)
            elif inner.get("type") == "array" and (item := _ref(inner.get("items", {}), defs)) is not None:
                child = Section(
                    path=f"{key}[]",
                    heading=code(f"{key}[]"),
                    schema=item,
                    description=item.get("description") or prop.get("description", ""),
                    depth=section.depth + 1,
                )
                section.children.append(child)
                walk(child)
            elif "oneOf" in inner and "discriminator" in inner:
                tag = inner["discriminator"]["propertyName"]
                for option in inner["oneOf"]:
                    target = _ref(option, defs)
                    assert target is not None, option
                    value = target["properties"][tag].get("const")
                    summary = summaries.get(str(value), "")
                    child = Section(
                        path=key,
                        heading=f"{code(key)} with {code(f'{tag}: {value}')}",
                        schema=target,
                        description=target.get("description")
                        or (f"{summary[:1].upper()}{summary[1:]}." if summary else prop.get("description", "")),
                        depth=section.depth + 1,
                    )
                    section.children.append(child)
                    walk(child)

    walk(root)
    return root


def _field(name: str, prop: Schema, required: bool, section: Section) -> str:
    """One field: its type and default on the first line, its description after."""
    inner, nullable = _nullable(prop)
    inner, words = _or_words(inner)
    key = name if section.depth == 0 else f"{section.path}.{name}"
    children = [c for c in section.children if c.path in (key, f"{key}[]")]
    if children and "oneOf" in inner:
        tag = inner["discriminator"]["propertyName"]
        kind = f"one section, chosen by {code(tag)}: " + ", ".join(
            _section_ref(c, code(f"{tag}: {c.schema['properties'][tag].get('const')}")) for c in children
        )
    elif children and inner.get("type") == "array":
        kind = f"list of {_section_ref(children[0])} sections"
        lo, hi = inner.get("minItems"), inner.get("maxItems")
        if lo is not None and hi is not None:
            kind += f", {lo} to {hi} items"
    elif children:
        kind = f"section {_section_ref(children[0])}" + "".join(f", or {code(str(w))}" for w in words)
    else:
        kind = _scalar(inner)
    if nullable and not children:
        kind += ", or not set"
    if required:
        status = "**required**"
    elif "default" in prop:
        status = f"default {_default(prop['default'])}"
    else:
        status = "optional"
    line = f"- {code(name)}: {kind}; {status}."
    description = prop.get("description", "")
    return f"{line}\\\n  {prose(description)}" if description else line


def _requirement(schema: Schema) -> str:
    """An object-level rule on which fields must be given (a workload: its maxima, or a trace)."""
    options = schema.get("anyOf")
    if not isinstance(options, list) or not all("required" in o for o in options):
        return ""
    alternatives = [" and ".join(code(k) for k in o["required"]) for o in options]
    return "Give " + ", or ".join(alternatives) + "."


def _contents(section: Section) -> list[str]:
    lines = [f"{'  ' * section.depth}- [{section.heading}](#{anchor(section.heading)})"]
    for child in section.children:
        lines.extend(_contents(child))
    return lines


def _sections(section: Section) -> list[str]:
    lines = [f"## {section.heading}", ""]
    if section.description:
        lines += [prose(section.description), ""]
    if rule := _requirement(section.schema):
        lines += [rule, ""]
    required = set(section.schema.get("required", []))
    for name, prop in section.schema.get("properties", {}).items():
        lines.append(_field(name, prop, name in required, section))
    lines.append("")
    for child in section.children:
        lines.extend(_sections(child))
    return lines


HEADER = """# Environment file reference

<!-- Generated by tools/env_reference.py from kvfleet/config/schema.py and kvfleet/targets/<name>/config.py: change
the models there, then run `python tools/env_reference.py`. tests/test_docs.py fails when this file is stale. -->

Every section and field of an environment file (`environments/<name>.yaml`), with its type, default, allowed
values and description, from the models kvfleet validates files with. `kvfleet schema` prints the same schema as
JSON Schema (committed as `environments/schema.json`; a file that starts with
`# yaml-language-server: $schema=./schema.json` gets completion and checking in editors). What the files are for
and how the sections fit together: [environment-files.md](environment-files.md).

Unknown keys are refused everywhere. A field marked **required** must be given; any other may be left out and
takes its default ("not set" leaves the choice to kvfleet, as its description says). Keys are written here as
paths: `deployments[].scaling.min_replicas` is `min_replicas` in the `scaling` section of each entry of
`deployments`.
"""


def render(schema: Schema | None = None) -> str:
    root = build(schema if schema is not None else environment_schema())
    lines = [HEADER, "## Contents", "", *_contents(root), "", *_sections(root)]
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the file differs from a fresh render")
    a = p.parse_args()
    text = render()
    if a.check:
        stale = not DOC.exists() or DOC.read_text(encoding="utf-8") != text
        print(f"{DOC.relative_to(REPO)} is {'stale: run tools/env_reference.py' if stale else 'current'}")
        return 1 if stale else 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
