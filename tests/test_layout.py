"""The code imports in one direction, without a circle (issues 26, 52). At the root: mpo.py and
search_env.py need none of the others; baselines.py and diagnostics.py only mpo.py; testbed_env.py
only search_env.py; presets.py the two tasks and the trainer's model room; train_min.py all of
them. The trainer's rooms (trainer/: config, model, critics, sampling, runs) import mpo.py,
diagnostics.py and each other downward only. The core imports nothing from experiments/ (issue
61). Every import counts, a function's own included."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("mpo", "baselines", "diagnostics", "search_env", "testbed_env", "trainer/config",
         "trainer/model", "trainer/critics", "trainer/sampling", "trainer/runs", "presets",
         "train_min")                                                     # in import order


def imports_of(name: str) -> set[str]:
    """The modules of FILES that FILES[name].py imports anywhere in its body ("trainer.x" as
    "trainer/x")."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / f"{name}.py").read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.replace(".", "/") for a in node.names}
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module.replace(".", "/"), node.module.split(".")[0]}
            found |= {f"{node.module}/{a.name}" for a in node.names}
    return found & set(FILES) - {name}


def test_code_imports_in_one_direction_only():
    graph = {name: imports_of(name) for name in FILES}
    assert graph == {
        "mpo": set(), "baselines": {"mpo"}, "diagnostics": {"mpo"}, "search_env": set(),
        "testbed_env": {"search_env"}, "trainer/config": set(), "trainer/model": set(),
        "trainer/critics": {"mpo", "trainer/model"}, "trainer/sampling": {"trainer/config"},
        "trainer/runs": {"diagnostics", "trainer/config"},
        "presets": {"search_env", "testbed_env", "trainer/model"},
        "train_min": {"mpo", "baselines", "diagnostics", "search_env", "presets",
                      "trainer/config", "trainer/model", "trainer/critics", "trainer/sampling",
                      "trainer/runs"}}
    order = {name: i for i, name in enumerate(FILES)}           # a topological order: no cycle
    assert all(order[dep] < order[name] for name, deps in graph.items() for dep in deps)


def test_the_layout_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    (tmp_path / "presets.py").write_text("def f():\n    import train_min\n    from mpo import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert imports_of("presets") == {"train_min", "mpo"}


def core_files() -> list[str]:
    """The core: FILES' root modules and every file in trainer/ (a new room included)."""
    rooms = sorted(f"trainer/{p.stem}" for p in (ROOT / "trainer").glob("*.py"))
    return [name for name in FILES if "/" not in name] + rooms


def experiments_imports(name: str) -> set[str]:
    """What <name>.py imports from the experiments package anywhere in its body
    ("experiments.<module>", or "experiments.<name>" for `from experiments import <name>`)."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / f"{name}.py").read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "experiments"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "experiments":
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_the_core_imports_nothing_from_the_studies():
    """Issue 61: mpo, baselines, diagnostics, the two environments, trainer/, presets and
    train_min import nothing from experiments/ (the testbed's environment is testbed_env.py)."""
    core = core_files()
    assert {"mpo", "testbed_env", "presets", "train_min", "trainer/config"} < set(core)
    assert {name: experiments_imports(name) for name in core} == {name: set() for name in core}


def test_the_core_check_sees_study_imports(tmp_path, monkeypatch):
    (tmp_path / "presets.py").write_text(
        "import mpo\ndef f():\n    from experiments import testbed_env\n"
        "    import experiments.launcher as l\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert experiments_imports("presets") == {"experiments.testbed_env", "experiments.launcher"}


def test_the_trainer_stays_one_readable_file_and_the_readme_five_minutes():
    """Issue 42: train_min.py at most 850 lines, none over 100 characters; README.md at most
    8,000 characters (its generated map included)."""
    lines = (ROOT / "train_min.py").read_text().splitlines()
    assert len(lines) <= 850, len(lines)
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 100]
    assert not long, f"train_min.py lines over 100 characters: {long}"
    assert len((ROOT / "README.md").read_text()) <= 8000


def test_the_docs_a_newcomer_reads_stay_short():
    """Issue 52: the markdown under docs/ outside docs/records/ (the dated lab records), generated
    tables included, at most 130 KB; mpo.py's first equation (M1) within its first 120 lines."""
    pages = [p for p in (ROOT / "docs").rglob("*.md") if "records" not in p.parts]
    size = sum(p.stat().st_size for p in pages)
    assert size <= 130_000, f"{size} bytes: move dated records to docs/records/ " + str(
        sorted((p.stat().st_size, str(p.relative_to(ROOT))) for p in pages)[-3:])
    first = next(i for i, line in enumerate((ROOT / "mpo.py").read_text().splitlines())
                 if line.startswith("def token_td_residuals"))
    assert first < 120, first


STUDIES = ("launcher", "testbed_lib", "testbed_map", "testbed_v2", "testbed", "grid", "testbed_why",
           "testbed_v4", "testbed_v4_beta", "testbed_oracle", "smol_study")   # in import order


def study_imports(name: str) -> set[str]:
    """The files of STUDIES that experiments/<name>.py imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / "experiments" / f"{name}.py").read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("experiments.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "experiments":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("experiments."):
            found.add(node.module.split(".")[1])
    return found & set(STUDIES) - {name}


def test_the_studies_import_downward_from_the_launcher():
    """Issue 52: experiments/launcher.py (one run, a grid of runs, the record files) imports no
    study; grid.py (the paper grids) the launcher and testbed.py, for its `testbed` command; the
    later studies what they use, never grid.py. Issue 61: the testbed's files by job, downward:
    testbed_lib.py (what the testbed studies share), testbed_map.py (the map), testbed_v2.py (v2,
    v3), testbed.py (v1 and the command line of v1-v3)."""
    graph = {name: study_imports(name) for name in STUDIES}
    assert graph == {
        "launcher": set(), "testbed_lib": {"launcher"}, "testbed_map": {"launcher", "testbed_lib"},
        "testbed_v2": {"launcher", "testbed_lib", "testbed_map"},
        "testbed": {"launcher", "testbed_lib", "testbed_v2"}, "grid": {"launcher", "testbed"},
        "testbed_why": {"launcher", "testbed_lib"},
        "testbed_v4": {"launcher", "testbed_lib", "testbed_map"},
        "testbed_v4_beta": {"launcher", "testbed_lib", "testbed_v4"},
        "testbed_oracle": {"launcher", "testbed_lib"}, "smol_study": {"launcher"}}
    order = {name: i for i, name in enumerate(STUDIES)}         # a topological order: no circle
    assert all(order[dep] < order[name] for name, deps in graph.items() for dep in deps)


def test_no_study_file_over_500_lines():
    """Issue 61: a study in experiments/ (launcher.py, significance.py and benchmarks/ are not
    studies) at most about 500 lines."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "experiments").glob("*.py")
             if p.name not in ("launcher.py", "significance.py")}
    assert sizes and all(n <= 500 for n in sizes.values()), sorted(sizes.items(), key=lambda x: x[1])
