"""Rewrite the line ranges of docs/equations.md's "Equations ↔ code" table from mpo.py itself.

    python docs/refresh_line_refs.py          # rewrite in place
    python docs/refresh_line_refs.py --check  # exit 1 if a range is stale (run by the tests)
"""
import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROW = re.compile(r"^(\| `(\w+)` \|.*\| )\[\d+–\d+\]\(\.\./mpo\.py#L\d+-L\d+\) \|$", re.M)


def spans() -> dict[str, tuple[int, int]]:
    tree = ast.parse((ROOT / "mpo.py").read_text())
    return {n.name: (n.lineno, n.end_lineno) for n in tree.body if isinstance(n, ast.FunctionDef)}


def refreshed(text: str) -> str:
    where = spans()

    def fix(m):
        a, b = where[m.group(2)]
        return f"{m.group(1)}[{a}–{b}](../mpo.py#L{a}-L{b}) |"
    return ROW.sub(fix, text)


if __name__ == "__main__":
    doc = ROOT / "docs" / "equations.md"
    old = doc.read_text()
    new = refreshed(old)
    if "--check" in sys.argv:
        sys.exit(0 if new == old else "docs/equations.md line ranges are stale: python docs/refresh_line_refs.py")
    doc.write_text(new)
