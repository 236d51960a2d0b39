"""The committed pages hold exactly what the studies' reports generate from the committed raw
files (issues 52, 53): docs/testbed.md's why-tables and v4-tables sections, docs/results.md's
why-summary and v4-summary, and the why and v4 studies' full tables in docs/records/testbed/. A raw
file, a report or a page edited alone fails here. The reports are run with their writes
captured, so nothing in the checkout changes."""
import re
from pathlib import Path

from experiments import launcher, testbed_lib, testbed_map
from experiments import testbed_v4 as v4
from experiments import testbed_why as why


def section(page: Path, name: str) -> str:
    m = re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", page.read_text(), re.S)
    assert m, f"{page} has no {name} section"
    return m.group(1)


def captured(monkeypatch, tmp_path) -> dict:
    written = {}
    monkeypatch.setattr(launcher, "update_page",
                        lambda page, name, text: written.setdefault((Path(page), name), text))
    monkeypatch.setattr(why, "curves", lambda records, path: path)
    monkeypatch.setattr(why, "RECORD_TABLES", tmp_path / "why-tables.md")
    monkeypatch.setattr(v4, "RECORD_TABLES", tmp_path / "v4-tables.md")
    return written


def assert_written_is_committed(written: dict, sections: set, record: Path) -> None:
    """The report wrote exactly `sections`, each as the page holds it, and its full tables
    (written to tmp_path) as docs/records/testbed/ holds them."""
    assert set(written) == sections
    for (page, name), text in written.items():
        assert section(page, name) == text, f"{page.name}: {name} is stale"
    committed = launcher.ROOT / "docs" / "records" / "testbed" / record.name
    assert committed.read_text() == record.read_text()


def test_the_why_study_pages_are_its_report(monkeypatch, tmp_path, capsys):
    written = captured(monkeypatch, tmp_path)
    why.report()
    assert_written_is_committed(written, {(testbed_lib.TESTBED_PAGE, why.PAGE_SECTION),
                                          (why.SUMMARY_PAGE, why.SUMMARY_SECTION)},
                                tmp_path / "why-tables.md")


def test_the_v4_study_pages_are_its_report(monkeypatch, tmp_path, capsys):
    written = captured(monkeypatch, tmp_path)
    maps = []
    monkeypatch.setattr(testbed_map, "write_map", lambda: maps.append(1))   # checked in test_grid
    v4.report()
    assert maps == [1]                 # the committed v4 records rewrite the map (it reads them)
    assert_written_is_committed(written, {(testbed_lib.TESTBED_PAGE, v4.PAGE_SECTION),
                                          (v4.SUMMARY_PAGE, v4.SUMMARY_SECTION)},
                                tmp_path / "v4-tables.md")


def test_the_beta_probe_page_is_its_report(monkeypatch, tmp_path, capsys):
    from experiments import testbed_v4_beta as beta
    written = captured(monkeypatch, tmp_path)
    beta.report()
    assert set(written) == {(beta.PAGE, beta.SECTION)}
    assert section(beta.PAGE, beta.SECTION) == written[(beta.PAGE, beta.SECTION)]
