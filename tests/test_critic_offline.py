"""experiments/critic_offline.py's pieces that need no model: the split by question, the
reference's features, explained variance, the report and the command line's checks."""
from __future__ import annotations

import gzip
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("critic_offline",
                                              ROOT / "experiments" / "critic_offline.py")
co = importlib.util.module_from_spec(spec)
spec.loader.exec_module(co)


class WordTok:
    """ids are indices into a word list; decode joins them with spaces."""
    words = ["<sys>", "Who", "founded", "X?", "search", "Y", "doc:", "Ann", "Lee", "answer", "Bob"]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.words[i] for i in ids)


def episode(position, reward, ids, turn_ids, answer="Ann Lee", hops=2):
    return {"q": position, "position": position, "answer": answer, "hops": hops,
            "reward": reward, "ids": ids, "turn_ids": turn_ids}


def test_split_holds_out_the_last_fifth_of_questions_whole():
    eps = [episode(p, 0.0, [0], [0]) for p in range(10) for _ in range(4)]
    train, held = co.split(eps)
    assert {e["position"] for e in train} == set(range(8))
    assert {e["position"] for e in held} == {8, 9} and len(held) == 8


def test_turn_start_features_see_the_answer_only_once_a_document_showed_it():
    #        question      turn 0        doc "Ann Lee"     turn 1        doc "Bob"  turn 2
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 6, 10, 9, 7, 8]
    tid = [-1, -1, -1, -1, 0, 0, -1, -1, -1, 1, 1, -1, -1, 2, 2, 2]
    rows = co.turn_starts(episode(0, 1.0, ids, tid, hops=3), WordTok())
    assert [p for p, _ in rows] == [4, 9, 13]
    #            1   turn1 turn2 turn3 turn4 3hops seen
    assert rows[0][1] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert rows[1][1] == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert rows[2][1] == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    # the answer inside the question (before the first turn) does not count
    q_ids = [0, 7, 8, 4, 5, 6, 10, 9]
    q_tid = [-1, -1, -1, 0, 0, -1, -1, 1]
    assert [f[-1] for _, f in co.turn_starts(episode(0, 0.0, q_ids, q_tid), WordTok())] == [0.0, 0.0]


def test_explained_variance_and_the_linear_reference():
    r = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert co.ev(r.clone(), r) == pytest.approx(1.0)
    assert co.ev(torch.full((4,), 0.5), r) == pytest.approx(0.0)
    assert co.ev(torch.tensor([1.0, 0.0, 1.0, 0.0]), r) == pytest.approx(-3.0)
    assert math.isnan(co.ev(r, torch.ones(4)))
    # success exactly when the answer was seen before turn 1: the reference explains it all
    seen = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]          # doc "Ann Lee" before turn 1
    unseen = [0, 1, 2, 3, 4, 5, 6, 10, 10, 9]      # doc "Bob Bob"
    tid = [-1, -1, -1, -1, 0, 0, -1, -1, -1, 1]
    eps = [episode(p, float(p % 2), seen if p % 2 else unseen, tid) for p in range(10)]
    ref = co.reference(*co.split(eps), WordTok())
    # turn 0 sees nothing: R = 0.5 there; turn 1: the feature decides
    assert ref["ev_turn_start_held"] == pytest.approx(0.5, abs=1e-9)
    assert ref["weights"][-1] == pytest.approx(1.0, abs=1e-4)


def test_report_reads_each_fit_record(tmp_path, monkeypatch):
    monkeypatch.setattr(co, "RESULTS", tmp_path)

    def row(epoch, held, first, train):
        return {"epoch": epoch, "held": {"ev_tokens": held, "ev_turn_start": first},
                "train": {"ev_tokens": train}}
    (tmp_path / "fit_top8.json").write_text(json.dumps({
        "name": "top8", "lora_layers": 8, "reference": {"ev_turn_start_held": 0.21},
        "per_epoch": [row(0, 0.0, 0.0, 0.0), row(1, 0.05, 0.12, 0.3), row(2, 0.02, 0.1, 0.6)]}))
    text = co.report(None, [])
    assert "| top8 | 8 | 2 | +0.050 (epoch 1) | +0.120 | +0.600 | +0.210 |" in text
    assert (tmp_path / "table.md").read_text() == text


def test_load_episodes_reads_every_chunk_and_names_a_missing_collection(tmp_path):
    (tmp_path / "episodes").mkdir()
    with pytest.raises(SystemExit, match="run `collect` first"):
        co.load_episodes(tmp_path)
    for start in (0, 16):
        with gzip.open(tmp_path / "episodes" / f"q{start:04d}.jsonl.gz", "wt") as f:
            f.write(json.dumps(episode(start, 1.0, [0], [0])) + "\n")
    assert [e["position"] for e in co.load_episodes(tmp_path)] == [0, 16]


@pytest.mark.parametrize("argv, message", [
    (["collect", "--questions", "20"], "--questions must be a positive multiple of 16"),
    (["fit", "--epochs", "0"], "--epochs must be >= 1"),
    (["fit", "--minibatch", "0"], "--minibatch must be >= 1"),
])
def test_bad_flags_stop_before_any_model_loads(argv, message, capsys):
    with pytest.raises(SystemExit):
        co.main(argv)
    assert message in capsys.readouterr().err
