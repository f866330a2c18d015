"""An evaluator for the part of CloudWatch metric math the stacks' alarms use, kept apart from kvfleet.scaling so the
rendered expressions are read the way CloudWatch reads them, not the way the code that wrote them means them.

Numbers, metric ids, + - * /, comparisons (< <= > >= == !=, 1 or 0), parentheses, arrays ``[a, b]`` and the
functions MAX(array), MIN(array), FILL(x, value) and IF(condition, a, b) (CloudWatch User Guide, "Metric math
syntax and functions"). A metric without a data point is None; arithmetic on None is None; FILL replaces it; a
division by zero gives no data point either (the alarm then applies its TreatMissingData).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

Value = float | None
TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)|([A-Za-z_]\w*)|(<=|>=|==|!=|[-+*/()<>\[\],]))")


def tokens(expression: str) -> list[str]:
    out: list[str] = []
    pos = 0
    while pos < len(expression.rstrip()):
        m = TOKEN.match(expression, pos)
        if m is None:
            raise ValueError(f"cannot read {expression[pos:]!r}")
        out.append(next(g for g in m.groups() if g is not None))
        pos = m.end()
    return out


def _arith(op: str, a: Value, b: Value) -> Value:
    if a is None or b is None:
        return None
    if op == "/":
        return None if b == 0 else a / b
    ops: dict[str, Callable[[float, float], float]] = {
        "+": lambda x, y: x + y,
        "-": lambda x, y: x - y,
        "*": lambda x, y: x * y,
        "<": lambda x, y: float(x < y),
        "<=": lambda x, y: float(x <= y),
        ">": lambda x, y: float(x > y),
        ">=": lambda x, y: float(x >= y),
        "==": lambda x, y: float(x == y),
        "!=": lambda x, y: float(x != y),
    }
    return ops[op](a, b)


class _Parser:
    def __init__(self, expression: str, values: Mapping[str, Value]) -> None:
        self.toks = tokens(expression)
        self.i = 0
        self.values = values

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.toks[self.i]
        if expected is not None and tok != expected:
            raise ValueError(f"expected {expected!r}, found {tok!r}")
        self.i += 1
        return tok

    def expression(self) -> Value:
        left = self.sum()
        while self.peek() in ("<", "<=", ">", ">=", "==", "!="):
            left = _arith(self.take(), left, self.sum())
        return left

    def sum(self) -> Value:
        left = self.product()
        while self.peek() in ("+", "-"):
            left = _arith(self.take(), left, self.product())
        return left

    def product(self) -> Value:
        left = self.atom()
        while self.peek() in ("*", "/"):
            left = _arith(self.take(), left, self.atom())
        return left

    def array(self) -> list[Value]:
        self.take("[")
        items = [self.expression()]
        while self.peek() == ",":
            self.take()
            items.append(self.expression())
        self.take("]")
        return items

    def atom(self) -> Value:
        tok = self.take()
        if tok == "(":
            v = self.expression()
            self.take(")")
            return v
        if tok == "-":
            v = self.atom()
            return None if v is None else -v
        if re.fullmatch(r"\d.*", tok):
            return float(tok)
        if self.peek() == "(":
            return self.call(tok)
        return self.values[tok]

    def call(self, name: str) -> Value:
        self.take("(")
        if name in ("MAX", "MIN"):
            items = [v for v in self.array() if v is not None]
            self.take(")")
            return (max if name == "MAX" else min)(items) if items else None
        args = [self.expression()]
        while self.peek() == ",":
            self.take()
            args.append(self.expression())
        self.take(")")
        if name == "FILL":
            return args[1] if args[0] is None else args[0]
        if name == "IF":
            condition, then, otherwise = args
            return None if condition is None else (then if condition != 0 else otherwise)
        raise ValueError(f"{name} is not in the subset this evaluator reads")


def evaluate(expression: str, values: Mapping[str, Value]) -> Value:
    """The expression's value for one period, from each metric id's value (None: no data point)."""
    p = _Parser(expression, values)
    v = p.expression()
    if p.peek() is not None:
        raise ValueError(f"{expression!r}: unread from {p.peek()!r}")
    return v
