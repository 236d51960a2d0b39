"""Every section reference in the repository resolves to docs/paper.md, and every equation label
the code and docs use is defined in its numbering table.

The files are read at test time (all .py, .md and .yaml files outside .git, virtual environments,
runs and caches), so a file added or rewritten by any change is covered."""

from __future__ import annotations

import ast
import fnmatch
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "docs" / "paper.md"
SUFFIXES = {".py", ".md", ".yaml", ".yml"}
SKIP_DIRS = {"runs", "node_modules", "__pycache__", "figures"}        # and every hidden folder

SIGN = chr(0xA7)                                     # the section sign, kept out of this file's text
SECTION = re.compile(SIGN + r"\s?(\d+(?:\.\d+)*)")                           # sign + 5, 10, 6.3
APPENDIX = re.compile(r"\bAppendix ([A-Z](?:\.\d+)*)\b")                     # Appendix C, Appendix A.7
BARE_APPENDIX = re.compile(r"(?<![\w.])([A-H]\.\d+)(?!\w|\.\d)")             # A.7
RESULT = re.compile(r"\b(Theorem|Lemma|Corollary|Algorithm) (\d+)\b")         # Theorem 2, Algorithm 1
EQ_NUMBER = re.compile(r"\bEqs?\.\s*\(?(\d+)\)?")                             # Eq. (20), Eq. 20
LABEL = re.compile(r"\(([MB]\d+)\)")                                          # (M3), (B1)
BARE_EQ = re.compile(r"\*\*\((\d+)\)|\((\d+)\)\s*[–-]\s*\((\d+)\)")         # **(5) …, (1)–(6)
HEADING = re.compile(r"^#{1,6} (" + SIGN + r"\d+(?:\.\d+)*|Appendix [A-Z](?:\.\d+)*)(?=[\s:.,]|$)",
                     re.M)
TABLE_ROW = re.compile(r"^\| (Eq\. \((\d+)\)|\(([MB]\d+)\)) \|.*\| `(\w+)` \|$", re.M)
NUMBERED_FILES = ("mpo.py", "docs/equations.md", "tests/api_examples.md", "tutorial/mpo_tutorial.py",
                  "tutorial/README.md")                   # where bare "(5)"-style numbers are banned


def repo_files() -> list[Path]:
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        out += [Path(folder) / f for f in sorted(files) if Path(f).suffix in SUFFIXES]
    return out


def paper_headings(text: str) -> set[str]:
    """'## §5 Worked example' -> '§5'; '## Appendix C: …' -> 'Appendix C'."""
    return set(HEADING.findall(text))


def section_refs(text: str) -> list[tuple[int, str]]:
    """(line, key) for every § and Appendix reference: '§5' -> '§5', 'A.7' -> 'Appendix A.7'."""
    refs = []
    for n, line in enumerate(text.splitlines(), 1):
        refs += [(n, SIGN + m) for m in SECTION.findall(line)]
        refs += [(n, "Appendix " + m) for m in APPENDIX.findall(line) + BARE_APPENDIX.findall(line)]
    return refs


def numbering_table(text: str) -> dict[str, str]:
    """Label -> mpo.py function, from the table under '## Equation numbering'."""
    section = text.split("## Equation numbering", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(4) for m in TABLE_ROW.finditer(section)}


def undefined_labels(text: str, table: dict[str, str]) -> list[tuple[int, str]]:
    """(line, label) for every equation label or number the table does not define."""
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        bad += [(n, f"Eq. ({x})") for x in EQ_NUMBER.findall(line) if f"Eq. ({x})" not in table]
        bad += [(n, f"({x})") for x in LABEL.findall(line) if f"({x})" not in table]
    return bad


def bare_numbers(text: str) -> list[tuple[int, str]]:
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1)
            for m in BARE_EQ.finditer(line)]


def unmask(text: str) -> str:
    """Drop '#': bogus samples are written masked so that this file's own scan does not flag them."""
    return text.replace("#", "")


def test_checkers_flag_bogus_references():
    """The parsers find each reference form, and unknown ones are reported (the test can fail)."""
    headings = paper_headings(f"# x\n## {SIGN}5 Worked example\n## Appendix A.7: error\n")
    assert headings == {f"{SIGN}5", "Appendix A.7"}
    text = unmask(f"see {SIGN}5, {SIGN}99 and {SIGN}5.1.\nAppendix A.7, A.7, Appendix C and B#.2 here.")
    refs, bogus = {k for _, k in section_refs(text)}, unmask("Appen#dix B.#2")
    assert refs == {f"{SIGN}5", f"{SIGN}99", f"{SIGN}5.1", "Appendix A.7", "Appendix C", bogus}
    assert refs - headings == {f"{SIGN}99", f"{SIGN}5.1", "Appendix C", bogus}
    table = {"Eq. (20)": "mae_projection", "(M1)": "token_td_residuals"}
    sample = unmask("Eq. (20) and Eq. 20, (M1); but Eq. (#5),\n(M#9) and (B#1) are unknown")
    assert undefined_labels(sample, table) == [(1, unmask("Eq. (#5)")), (2, unmask("(M#9)")), (2, "(B1)")]
    assert bare_numbers("**(5) Whitening**, and (1)–(6) composed") == [(1, "**(5)"), (1, "(1)–(6)")]


def test_paper_has_one_heading_per_section_of_the_notes():
    text = PAPER.read_text()
    numbers = re.findall(r"^## " + SIGN + r"(\d+) ", text, re.M)
    assert numbers == [str(n) for n in range(1, 13)], numbers       # the notes' §1–§12, in order
    assert {"Appendix C", "Appendix A.7"} <= paper_headings(text)


def test_every_section_reference_resolves_to_a_paper_heading():
    headings = paper_headings(PAPER.read_text())
    found, missing = 0, []
    for path in repo_files():
        for n, key in section_refs(path.read_text(errors="replace")):
            found += 1
            if key not in headings:
                missing.append(f"{path.relative_to(ROOT)}:{n}: {key}")
    assert found > 100, f"only {found} references found: is the scanner reading the repository?"
    assert not missing, "references without a heading in docs/paper.md:\n" + "\n".join(missing)


def test_every_cited_theorem_and_algorithm_is_in_the_paper_summary():
    paper = PAPER.read_text()
    missing = sorted({f"{path.relative_to(ROOT)}: {kind} {num}" for path in repo_files()
                      for kind, num in RESULT.findall(path.read_text(errors="replace"))
                      if f"{kind} {num}" not in paper})
    assert not missing, "cited but not described in docs/paper.md:\n" + "\n".join(missing)


def test_equation_labels_are_defined_by_the_numbering_table():
    table = numbering_table(PAPER.read_text())
    expected = {"Eq. (20)"} | {f"(M{i})" for i in range(1, 9)} | {f"(B{i})" for i in range(1, 4)}
    assert set(table) == expected, sorted(table)
    undefined, bare = [], []
    for path in repo_files():
        text = path.read_text(errors="replace")
        rel = path.relative_to(ROOT).as_posix()
        undefined += [f"{rel}:{n}: {x}" for n, x in undefined_labels(text, table)]
        if rel in NUMBERED_FILES or fnmatch.fnmatch(rel, "tutorial/*.py"):   # every chapter
            bare += [f"{rel}:{n}: {x}" for n, x in bare_numbers(text)]
    assert not undefined, "equation labels not in docs/paper.md's table:\n" + "\n".join(undefined)
    assert not bare, "bare equation numbers (use the table's labels):\n" + "\n".join(bare)


def test_each_label_is_named_by_its_function_in_mpo_and_the_docs():
    """The docstring, the equations.md row and the tests/api_examples.md section of each function carry the label
    the numbering table gives it, so mpo.py, equations.md and the API examples number alike."""
    table = numbering_table(PAPER.read_text())
    tree = ast.parse((ROOT / "mpo.py").read_text())
    docstrings = {f.name: ast.get_docstring(f) or "" for f in tree.body if isinstance(f, ast.FunctionDef)}
    equations = (ROOT / "docs" / "equations.md").read_text()
    api = (ROOT / "tests" / "api_examples.md").read_text()
    problems = []
    for label, func in table.items():
        if label not in docstrings.get(func, ""):
            problems.append(f"mpo.{func} docstring lacks {label}")
        row = re.search(rf"^\| `{func}` \|.*$", equations, re.M)
        if row is None or label not in row.group(0):
            problems.append(f"docs/equations.md row of {func} lacks {label}")
        section = re.search(rf"^## `{func}`\n(.*?)(?=^## |\Z)", api, re.M | re.S)
        if section is None or label not in section.group(1):
            problems.append(f"tests/api_examples.md section of {func} lacks {label}")
    assert not problems, "\n".join(problems)
