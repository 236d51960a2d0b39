"""The root files import each other without a circle (issue 26): mpo.py and search_env.py need
none of the others, baselines.py and diagnostics.py only mpo.py (issue 52), run_utils.py mpo.py
and diagnostics.py, presets.py search_env.py and run_utils.py, train_min.py all of them. Every
import counts, a function's own included."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("mpo", "baselines", "diagnostics", "search_env", "run_utils", "presets",
         "train_min")                                                     # in import order


def imports_of(name: str) -> set[str]:
    """The root modules that FILES[name].py imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / f"{name}.py").read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(FILES) - {name}


def test_root_files_import_in_one_direction_only():
    graph = {name: imports_of(name) for name in FILES}
    assert graph == {"mpo": set(), "baselines": {"mpo"}, "diagnostics": {"mpo"},
                     "search_env": set(), "run_utils": {"mpo", "diagnostics"},
                     "presets": {"search_env", "run_utils"},
                     "train_min": {"mpo", "baselines", "diagnostics", "search_env", "run_utils",
                                   "presets"}}
    order = {name: i for i, name in enumerate(FILES)}           # a topological order: no cycle
    assert all(order[dep] < order[name] for name, deps in graph.items() for dep in deps)


def test_the_layout_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    (tmp_path / "presets.py").write_text("def f():\n    import train_min\n    from mpo import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert imports_of("presets") == {"train_min", "mpo"}


def test_the_trainer_stays_one_readable_file_and_the_readme_five_minutes():
    """Issue 42: train_min.py at most 850 lines, none over 100 characters; README.md at most
    8,000 characters (its generated map included)."""
    lines = (ROOT / "train_min.py").read_text().splitlines()
    assert len(lines) <= 850, len(lines)
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 100]
    assert not long, f"train_min.py lines over 100 characters: {long}"
    assert len((ROOT / "README.md").read_text()) <= 8000
