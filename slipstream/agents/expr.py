"""Safe arithmetic: evaluate an expression a model wrote without ever running it as Python.

The calculator tool and the countdown reward both evaluate text the model produced. ``eval`` would run
arbitrary code; libraries such as sympy parse with ``eval`` too. This walks Python's own parse tree
(``ast``) and accepts only numbers, ``+ - * / // % **``, unary signs, parentheses and a short list of
math functions, with bounds that stop ``9**9**9``-style blow-ups, so it is a few dozen lines we can
reason about completely.

Worked example::

    safe_eval("(3 + 4) * 2 ** 3")   # 56
    safe_eval("sqrt(16) / 3")       # 1.3333333333333333
    safe_eval("__import__('os')")   # ExpressionError: unsupported syntax: Call of `__import__`
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

Number = int | float

MAX_EXPRESSION_CHARS = 1000
# Exponents and operands bounded so that no expression takes noticeable time or memory.
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 10**300

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "min": min,
    "max": max,
}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


class ExpressionError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


def safe_eval(expression: str) -> Number:
    """The value of an arithmetic ``expression``; raises :class:`ExpressionError` for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ExpressionError(f"not an expression: {err.msg}") from None
    try:
        return _eval(tree.body)
    except ZeroDivisionError:
        raise ExpressionError("division by zero") from None
    except (OverflowError, ValueError, TypeError) as err:
        if isinstance(err, ExpressionError):
            raise
        raise ExpressionError(f"cannot evaluate: {err}") from None


def numbers_in(expression: str) -> list[Number]:
    """The numeric literals of ``expression`` in order (countdown checks each given number is used once)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ExpressionError(f"not an expression: {err.msg}") from None
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and _is_number(n.value)]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check(value: Number) -> Number:
    if isinstance(value, complex) or not _is_number(value):
        raise ExpressionError(f"result {value!r} is not a real number")
    if abs(value) > MAX_MAGNITUDE:
        raise ExpressionError("result is too large")
    return value


def _eval(node: ast.expr) -> Number:
    if isinstance(node, ast.Constant) and _is_number(node.value):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ExpressionError(f"exponent larger than {MAX_EXPONENT}")
        return _check(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _check(_FUNCTIONS[node.func.id](*(_eval(arg) for arg in node.args)))
    detail = f" of `{node.func.id}`" if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else ""
    raise ExpressionError(f"unsupported syntax: {type(node).__name__}{detail}")
