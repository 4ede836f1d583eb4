"""Example tools for ``kvagent chat`` (``skills/assistant_tools.yaml`` declares them): a calculator, a reader of
text files under one folder, and the demo shop's order lookup. Each checks its input and raises a clear error,
which goes back to the model as the call's result (``kvagent.tools.run``)."""

from __future__ import annotations

import ast
import operator
import os
from pathlib import Path

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
        ast.UAdd: operator.pos}
ORDERS = {
    "A-1042": {"status": "shipped", "carrier": "DHL", "delivery_date": "2026-12-04", "total_eur": 129.90},
    "B-2210": {"status": "processing", "carrier": None, "delivery_date": None, "total_eur": 54.00},
}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); nothing else is evaluated."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(value(node.right)) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](value(node.left), value(node.right))  # type: ignore[no-any-return]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))  # type: ignore[no-any-return]
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {expression!r}") from exc
    return repr(value(tree.body))


def read_file(path: str) -> str:
    """The text of a file under the folder ``$KVAGENT_FILES`` (default: the current folder), at most 4,000
    characters; paths outside it are refused."""
    root = Path(os.environ.get("KVAGENT_FILES", ".")).resolve()
    target = (root / path).resolve()
    if root != target and root not in target.parents:
        raise PermissionError(f"{path!r} is outside {root}")
    if not target.is_file():
        raise FileNotFoundError(f"no file {path!r} under {root}")
    return target.read_text(encoding="utf-8", errors="replace")[:4000]


def lookup_order(order_number: str) -> dict[str, object]:
    """The demo shop's order record: status, carrier, delivery date, total."""
    order = ORDERS.get(order_number.strip().upper())
    if order is None:
        raise KeyError(f"no order {order_number!r} (known: {', '.join(ORDERS)})")
    return {"order_number": order_number.strip().upper(), **order}
