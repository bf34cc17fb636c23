"""Reading the package's own source in the tests that walk it (imports, private names)."""

from __future__ import annotations

import ast


def parse(path: str) -> ast.Module:
    """``ast.parse`` of a file. CPython 3.11 before 3.11.8 can raise a spurious ``SystemError: AST constructor
    recursion depth mismatch`` (gh-106905: the AST converter's depth counter goes wrong, seen here once in a full
    suite); the same text parses on a second try, so a parse is tried again a few times before the error stands."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for attempt in range(3):
        try:
            return ast.parse(text, path)
        except SystemError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")
