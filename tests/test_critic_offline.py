"""experiments/records/smol/critic_offline.py's pieces that need no model: the split by question, the
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
                                              ROOT / "experiments" / "records" / "smol" / "critic_offline.py")
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
                "train": {"ev_tokens": train, "ev_turn_start": train}}
    (tmp_path / "fit_top8.json").write_text(json.dumps({
        "name": "top8", "lora_layers": 8, "reference": {"ev_turn_start_held": 0.21},
        "per_epoch": [row(0, 0.0, 0.0, 0.0), row(1, 0.05, 0.12, 0.3), row(2, 0.02, 0.09, 0.6)]}))
    (tmp_path / "fit_turn.json").write_text(json.dumps({
        "name": "turn", "lora_layers": 8, "lora_r": 8, "trained_params": 1234,
        "design": {"target": "turn", "value_clip": 0.2, "passes": 2, "head": "mlp",
                   "features": "concat4", "separate": False},
        "reference": {"ev_turn_start_held": 0.21},
        "per_epoch": [row(0, 0.0, 0.0, 0.0), row(1, 0.05, 0.08, 0.3), row(2, 0.02, 0.11, 0.6)]}))
    (tmp_path / "probe_frozen.json").write_text(json.dumps({
        "name": "frozen", "reference": {"ev_turn_start_held": 0.21}, "layers": [
            {"layer": 0, "cv_mse": 0.2, "ev_turn_start_held": 0.05, "ev_tokens_held": 0.04,
             "ev_turn_start_train": 0.1},
            {"layer": 2, "cv_mse": 0.3, "ev_turn_start_held": 0.15, "ev_tokens_held": 0.14,
             "ev_turn_start_train": 0.2}]}))
    text = co.report(None, [])
    # the pass mark reads the last epoch (0.09: fail, though epoch 1 had 0.12), and the probe's
    # CV-chosen layer (0: fail, though layer 2 does better on the held-out questions)
    assert ("| top8 | LoRA r16 top 8, linear head on last, target token, clip none, 1 pass | – | 2 "
            "| +0.090 fail | +0.120 (1) | +0.020 | +0.600 | +0.210 |") in text
    assert ("| turn | LoRA r8 top 8, mlp head on concat4, target turn, clip 0.2, 2 passes | 1234 "
            "| 2 | +0.110 **pass** | +0.110 (2) |") in text
    assert "ridge on layer 0 (chosen by 5-fold CV" in text and "+0.050 fail | +0.150 (layer 2)" in text
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
    (["fit", "--passes", "0"], "--passes must be >= 1"),
    (["fit", "--value_clip", "-0.1"], "--value_clip must be >= 0"),
    (["fit", "--target", "step"], "invalid choice"),
    (["head", "--steps", "0"], "--steps must be >= 1"),
])
def test_bad_flags_stop_before_any_model_loads(argv, message, capsys):
    with pytest.raises(SystemExit):
        co.main(argv)
    assert message in capsys.readouterr().err


def test_turn_starts_and_a_turn_level_critics_token_values():
    tid = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, -1],
                        [-1, -1, 0, -1, -1, 1, 2, 2]])
    first = co.turn_starts_mask(tid)
    assert first.nonzero().tolist() == [[0, 1], [0, 5], [1, 2], [1, 5], [1, 6]]
    v = torch.arange(16, dtype=torch.float).view(2, 8)
    out = co.at_turn_start(v, tid)
    # action tokens take their turn's first value; the rest keep theirs
    assert out[0].tolist() == [0, 1, 1, 1, 4, 5, 5, 7]
    assert out[1].tolist() == [8, 9, 10, 11, 12, 13, 14, 14]


def test_ridge_recovers_a_linear_rule_and_shrinks_to_the_mean():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=g, dtype=torch.float64)
    y = 0.3 + x @ torch.tensor([1.0, -2.0, 0.0, 0.5, 0.0], dtype=torch.float64)
    pred = co.ridge_fit(x, y, 1e-6)
    assert co.ev(pred(x), y) == pytest.approx(1.0, abs=1e-6)
    flat = co.ridge_fit(x, y, 1e9)(x)
    assert torch.allclose(flat, torch.full_like(flat, float(y.mean())), atol=1e-3)


def test_mlp_head_starts_at_zero_and_can_learn():
    head = co.MLPHead(6, width=16)
    h = torch.randn(3, 4, 6)
    assert head(h).shape == (3, 4) and torch.all(head(h) == 0)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    target = h[..., 0] * 2
    for _ in range(300):
        opt.zero_grad()
        loss = ((head(h) - target) ** 2).mean()
        loss.backward()
        opt.step()
    assert float(loss) < 0.05 * float((target ** 2).mean())


@pytest.fixture(scope="module")
def tiny(tiny_path, base):
    """The tests' shared tiny Qwen2 (2 layers; tests/conftest.py: `tiny_path`) and this module's
    folder, as the pair the tests below unpack."""
    return tiny_path, base


def toy_episodes(n: int = 8) -> list[dict]:
    """R = 1 exactly when the prompt's first token is 5 (id 7 otherwise): a rule a critic can read
    from the prefix at every position."""
    eps = []
    for i in range(n):
        first = 5 if i % 2 else 7
        ids = [first, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
        tid = [-1, -1, 0, 0, 0, -1, -1, 1, 1, -1, 2, 2]
        eps.append(episode(i, float(i % 2), ids, tid))
    return eps


@pytest.mark.parametrize("design, trainer", [
    (dict(target="token", head="linear", features="last", separate=False), ["--lora_layers", "1"]),
    (dict(target="turn", head="mlp", features="concat2", separate=False), ["--lora_layers", "2"]),
    (dict(target="token", head="linear", features="last", separate=True), ["--lora_layers", "1"]),
])
def test_each_critic_design_fits_a_readable_outcome_and_trains_only_its_own_weights(
        tiny, design, trainer):
    import train_min
    from types import SimpleNamespace
    path, base = tiny
    torch.manual_seed(0)
    cfg = train_min.parse_config(["--preset", "tiny", "--model", path, "--out_dir",
                                  str(base / "u"), "--load_in_4bit", "false", "--lr_critic", "3e-3",
                                  "--lr_value_head", "3e-2", *trainer])
    tok, model, _ = train_min.load_model(cfg, torch.device("cpu"))
    args = SimpleNamespace(value_clip=0.0, passes=1, **design)
    critic = co.Critic(model, cfg, args, torch.device("cpu"))
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters()
                     if ".critic." not in n}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if ".critic." in n}
    eps = toy_episodes()
    states = co.lower_states(model, eps, cfg, torch.device("cpu"), tok.pad_token_id)
    assert co.evaluate(critic, eps, states, cfg, torch.device("cpu"), tok.pad_token_id)[
        "mean_v"] == 0.0                                       # zero-initialised head: V = 0
    opt = torch.optim.AdamW(critic.groups, weight_decay=0.0)
    for _ in range(60):
        co.update(critic, opt, eps, states, cfg, torch.device("cpu"), tok.pad_token_id, args)
    out = co.evaluate(critic, eps, states, cfg, torch.device("cpu"), tok.pad_token_id)
    assert out["ev_turn_start"] > 0.8 and out["ev_tokens"] > 0.8, out
    for n, p in model.named_parameters():                       # the frozen base never moves
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n]), n
    moved = any(not torch.equal(p, lora_before[n]) for n, p in model.named_parameters()
                if n in lora_before)
    assert moved != design["separate"]       # the separate critic leaves the LoRA adapter alone
    if design["separate"]:
        assert critic.layers is not None and all(p.requires_grad for p in critic.layers.parameters())


def test_episodes_of_a_batch_are_the_episodes_it_was_collated_from():
    eps = toy_episodes(4)
    eps[1]["ids"], eps[1]["turn_ids"] = eps[1]["ids"][:7], eps[1]["turn_ids"][:7]   # shorter
    batch = co.as_batch(eps, torch.device("cpu"), pad_id=0)
    assert batch["ids"].shape == (4, 12)
    back = co.episodes_of(batch)
    for e, b in zip(eps, back, strict=True):
        assert (b["ids"], b["turn_ids"], b["reward"]) == (e["ids"], e["turn_ids"], e["reward"])
    again = co.as_batch(back, torch.device("cpu"), pad_id=0)
    for k in ("ids", "attn", "turn_ids", "scores"):
        assert torch.equal(again[k], batch[k]), k


def test_concat_features_need_enough_layers(tiny):
    import train_min
    from types import SimpleNamespace
    path, base = tiny
    cfg = train_min.parse_config(["--preset", "tiny", "--model", path, "--out_dir",
                                  str(base / "u"), "--load_in_4bit", "false", "--lora_layers", "1"])
    _, model, _ = train_min.load_model(cfg, torch.device("cpu"))
    args = SimpleNamespace(value_clip=0.0, passes=1, target="token", head="linear",
                           features="concat4", separate=False)
    with pytest.raises(SystemExit, match="--features concat4 needs 3 or more layers"):
        co.Critic(model, cfg, args, torch.device("cpu"))


def test_lower_states_are_cached_per_split_and_recomputed_for_other_episodes(tiny, monkeypatch):
    import train_min
    path, base = tiny
    cfg = train_min.parse_config(["--preset", "tiny", "--model", path, "--out_dir",
                                  str(base / "u"), "--load_in_4bit", "false", "--lora_layers", "1"])
    tok, model, _ = train_min.load_model(cfg, torch.device("cpu"))
    eps, cache = toy_episodes(4), base / "lower.pt"
    first = co.lower_states(model, eps, cfg, torch.device("cpu"), tok.pad_token_id, cache)
    assert cache.exists() and first[0].shape == (12, model.config.hidden_size)
    calls = []
    real = train_min.frozen_states
    monkeypatch.setattr(train_min, "frozen_states", lambda *a: calls.append(1) or real(*a))
    again = co.lower_states(model, eps, cfg, torch.device("cpu"), tok.pad_token_id, cache)
    assert calls == [] and all(torch.equal(a, b) for a, b in zip(first, again))
    other = toy_episodes(4)
    other[0]["reward"] = 0.5                                   # different episodes: recomputed
    co.lower_states(model, other, cfg, torch.device("cpu"), tok.pad_token_id, cache)
    assert calls


def tiny_command(tiny, tmp_path, monkeypatch, n: int) -> None:
    """n toy episodes (one question each) in tmp_path/episodes, setup() replaced by the tiny
    model (the real one loads the warm-started SmolLM2), records to tmp_path/results."""
    import train_min
    path, base = tiny
    eps = toy_episodes(n)
    for e in eps:
        e["position"] = e["q"] = eps.index(e)
    (tmp_path / "episodes").mkdir()
    with gzip.open(tmp_path / "episodes" / "q0000.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(e) + "\n" for e in eps)

    def tiny_setup(extra, seed, out):
        cfg = train_min.parse_config(["--preset", "tiny", "--model", path, "--out_dir",
                                      str(base / "u"), "--load_in_4bit", "false", *extra])
        tok, model, head = train_min.load_model(cfg, torch.device("cpu"))
        return cfg, torch.device("cpu"), None, tok, model, head
    monkeypatch.setattr(co, "setup", tiny_setup)
    monkeypatch.setattr(co, "RESULTS", tmp_path / "results")


def test_fit_runs_end_to_end_writes_its_record_and_caches_the_frozen_layers(
        tiny, tmp_path, monkeypatch):
    """The whole `fit` command on the tiny model (setup() is the only piece replaced: the real
    one loads the warm-started SmolLM2)."""
    tiny_command(tiny, tmp_path, monkeypatch, 10)
    co.main(["fit", "--out", str(tmp_path), "--name", "t", "--epochs", "1", "--target", "turn",
             "--value_clip", "0.2", "--passes", "2", "--", "--lora_layers", "1"])
    record = json.loads((tmp_path / "results" / "fit_t.json").read_text())
    assert [row["epoch"] for row in record["per_epoch"]] == [0, 1]
    assert record["design"]["target"] == "turn" and record["n_train"] == 8
    assert record["n_held"] == 2 and record["lora_layers"] == 1
    assert sorted(p.name for p in tmp_path.glob("lower-top1-*.pt")) == [
        "lower-top1-float32-held.pt", "lower-top1-float32-train.pt"]


def test_a_stopped_fit_continues_exactly_and_refuses_other_settings(tiny, tmp_path, monkeypatch):
    """A fit stopped after epoch 1 and run again with --epochs 2 ends where one uninterrupted
    2-epoch fit ends: the same numbers after every epoch (weights, optimiser and random state
    restored). Another design under the same --name stops before any model loads."""
    tiny_command(tiny, tmp_path, monkeypatch, 10)
    flags = ["--target", "turn", "--value_clip", "0.2", "--passes", "2", "--", "--lora_layers", "1"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for d in (whole, parts):
        d.mkdir()
        (d / "episodes").symlink_to(tmp_path / "episodes")
    co.main(["fit", "--out", str(whole), "--name", "w", "--epochs", "2", *flags])
    co.main(["fit", "--out", str(parts), "--name", "p", "--epochs", "1", *flags])
    stopped = json.loads((tmp_path / "results" / "fit_p.json").read_text())
    assert [r["epoch"] for r in stopped["per_epoch"]] == [0, 1] and stopped["epochs"] == 1
    co.main(["fit", "--out", str(parts), "--name", "p", "--epochs", "2", *flags])
    a = json.loads((tmp_path / "results" / "fit_w.json").read_text())
    b = json.loads((tmp_path / "results" / "fit_p.json").read_text())
    assert [r["epoch"] for r in b["per_epoch"]] == [0, 1, 2] and b["epochs"] == 2
    assert b["resumed"][0]["epoch"] == 2 and "resumed" not in a
    for ra, rb in zip(a["per_epoch"], b["per_epoch"], strict=True):
        assert ra["held"] == rb["held"] and ra["train"] == rb["train"]
    assert a["per_epoch"][2]["held"]["mean_v"] != a["per_epoch"][1]["held"]["mean_v"]

    monkeypatch.setattr(co, "setup", lambda *a: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit, match="already ran 2 epochs; pass --epochs > 2"):
        co.main(["fit", "--out", str(parts), "--name", "p", "--epochs", "2", *flags])
    with pytest.raises(SystemExit, match="with other settings"):
        co.main(["fit", "--out", str(parts), "--name", "p", "--epochs", "3", "--target", "token",
                 "--", "--lora_layers", "1"])


# --- the trainer's turn critic, replayed (`head`, issue 41 part 2) ------------------------------

def head_rows(n: int, g: torch.Generator, w: torch.Tensor, turns: int = 3) -> list[dict]:
    """Episodes as cached_turn_features gives them: x (1, turns, H), one state per episode seen
    at each turn start with a little noise, its scale differing by dimension; R(τ) = 1 when
    that state's w·z > 0."""
    rows = []
    for i in range(n):
        z = torch.randn(len(w), generator=g)
        x = (z + 0.1 * torch.randn(1, turns, len(w), generator=g)) * torch.logspace(-1, 1, len(w))
        rows.append({"x": x + 3, "tokens": torch.full((turns,), 5.0), "R": float(z @ w > 0),
                     "position": i})
    return rows


def test_replayed_turn_critic_learns_a_readable_outcome_in_the_trainers_schedule():
    import train_min
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, generator=g)
    train, held = head_rows(384, g, w), head_rows(200, g, w)
    cfg = train_min.parse_config(["--preset", "smol_hops", "--out_dir", "/tmp/unused"])
    assert (cfg.questions_per_step * cfg.n_rollouts, cfg.ppo_epochs, cfg.minibatches) == (16, 2, 4)
    trained = co.replay_head(train, cfg, 3e-3, steps=24, seed=0)
    assert int(trained.stats.count) == 384 * 3              # every turn start observed once
    assert co.head_scores(trained, held)["ev_turn_start"] > 0.3
    untrained = co.replay_head(train, cfg, 0.0, steps=24, seed=0)
    assert co.head_scores(untrained, held)["sd_v"] == 0.0   # lr 0: the zero head stays at 0
    ridge, lams, fresh = co.replay_ridge(train, cfg, steps=24, seed=0)     # train_min's head
    assert len(lams) == 24 and int(ridge.n_seen) == 384 * 3
    assert co.head_scores(ridge, held)["ev_turn_start"] > 0.3
    # the fresh-batch EV before each refit: 0 for the zero head on its first batch, then the
    # refitted head predicts each next batch (the trainer's critic/ev_outcome gate)
    assert len(fresh) == 24 and fresh[0] == pytest.approx(0.0) and min(fresh[4:]) > 0.2
    lam_head, _, lam_fresh = co.replay_ridge(train, cfg, steps=24, seed=0, target="lambda")
    assert int(lam_head.n_seen) == 384 * 3 and lam_fresh[0] == pytest.approx(0.0)
    assert not torch.equal(lam_head.linear.weight, ridge.linear.weight)
    loqo, loqo_lams, _ = co.replay_ridge(train, cfg, steps=24, seed=0, cv="question")
    assert loqo.cv == "question" and int(loqo.n_seen) == 384 * 3 and len(loqo_lams) == 24
    assert co.head_scores(loqo, held)["ev_turn_start"] > 0.3
    order = co.replay_order(train, 0, grouped=True)          # head_rows: one question each
    assert sorted(order) == list(range(384))


def test_grouped_replay_keeps_each_questions_episodes_together():
    rows = [{"position": q} for q in (0, 0, 1, 1, 2, 2)]
    order = co.replay_order(rows, 3, grouped=True)
    assert sorted(order) == list(range(6))
    assert all(rows[order[i]]["position"] == rows[order[i + 1]]["position"] for i in (0, 2, 4))


def test_turn_lambda_returns_by_hand():
    v = torch.tensor([0.2, 0.5], dtype=torch.float64)
    # A_1 = 1 − 0.5 = 0.5, G_1 = 1.0; A_0 = 0.5 − 0.2 + 0.8 · 0.5 = 0.7, G_0 = 0.9
    assert co.turn_lambda_returns(v, 1.0, 0.8).tolist() == pytest.approx([0.9, 1.0])
    assert co.turn_lambda_returns(v, 1.0, 1.0).tolist() == pytest.approx([1.0, 1.0])  # MC: R
    assert co.turn_lambda_returns(v, 0.0, 0.0).tolist() == pytest.approx([0.5, 0.0])  # TD(0)


def test_head_runs_end_to_end_chooses_its_rate_by_cv_and_caches_features(
        tiny, tmp_path, monkeypatch):
    tiny_command(tiny, tmp_path, monkeypatch, 20)
    argv = ["head", "--out", str(tmp_path), "--steps", "3", "--", "--questions_per_step", "1",
            "--n_rollouts", "4", "--minibatches", "2"]
    record = co.main(argv)
    assert record["name"] == "turn_critic" and record["n_train"] == 16 and record["n_held"] == 4
    assert record["lr"] == float(min(record["cv_mse"], key=record["cv_mse"].get))
    assert set(record["per_lr"]) == {str(r) for r in co.HEAD_RATES}
    assert record["episodes_per_step"] == 4 and record["all_training_episodes"]["steps"] == 4
    assert record["pass"] == (record["held"]["ev_turn_start"] >= co.PASS_MARK)
    assert json.loads((tmp_path / "results" / "head_turn_critic.json").read_text()) == record
    layer = record["layer"]
    assert sorted(p.name for p in tmp_path.glob("turnfeat-*.pt")) == [
        f"turnfeat-L{layer}-float32-held.pt", f"turnfeat-L{layer}-float32-train.pt"]

    def recompute(*a, **k):
        raise AssertionError("the cached features were not used")
    monkeypatch.setattr(co, "turn_start_features", recompute)
    again = co.main(argv)
    assert again["cv_mse"] == record["cv_mse"] and again["held"] == record["held"]


def test_report_gives_a_head_record_its_verdict_and_a_stopped_fit_none(tmp_path, monkeypatch):
    monkeypatch.setattr(co, "RESULTS", tmp_path)
    (tmp_path / "head_turn_critic.json").write_text(json.dumps({
        "name": "turn_critic", "layer": 16, "lr": 0.001, "steps": 24, "episodes_per_step": 16,
        "ppo_epochs": 2, "minibatches": 4, "trained_params": 577, "pass": False,
        "held": {"ev_turn_start": 0.04, "ev_tokens": 0.03}, "train": {"ev_turn_start": 0.2},
        "per_lr": {"0.001": {"held": {"ev_turn_start": 0.04}},
                   "0.003": {"held": {"ev_turn_start": 0.12}}},
        "reference": {"ev_turn_start_held": 0.178}}))
    (tmp_path / "fit_b.json").write_text(json.dumps({
        "name": "b", "lora_layers": 8, "epochs": 3, "reference": {"ev_turn_start_held": 0.178},
        "per_epoch": [{"epoch": e, "held": {"ev_tokens": 0.0, "ev_turn_start": 0.2},
                       "train": {"ev_tokens": 0.0, "ev_turn_start": 0.0}} for e in (0, 1)]}))
    text = co.report(None, [])
    assert "frozen layer 16" in text and "lr 0.001 (5-fold CV)" in text
    assert "| 577 | 24 steps | +0.040 fail | +0.120 (lr 0.003) | +0.030 | +0.200 | +0.178 |" in text
    assert "+0.200 stopped after 1 of 3 |" in text          # no verdict on a cut-short fit


def test_transfer_scores_the_offline_heads_beside_a_runs_own_critic(tiny, tmp_path, monkeypatch):
    """`transfer` on an appendix_c --save file: the run's critic re-read from its checkpoint and
    scored on features computed here gives the saved values (else it stops), and every offline
    head gets its row of final_critics statistics."""
    import copy

    import trainer.critics
    import train_min
    from safetensors.torch import save_file
    tiny_command(tiny, tmp_path, monkeypatch, 20)
    eps = [dict(e, position=i) for i, e in enumerate(toy_episodes(6))]
    path, base = tiny
    cfg = train_min.parse_config(["--preset", "tiny", "--model", path, "--out_dir",
                                  str(base / "u"), "--load_in_4bit", "false"])
    _, model, _ = train_min.load_model(cfg, torch.device("cpu"))
    layer = model.config.num_hidden_layers // 2 + 1
    rows = co.turn_start_features(model, eps, cfg, torch.device("cpu"), 0, [layer])
    own = trainer.critics.TurnValueHead(rows[0]["x"].shape[-1], layer, cfg.critic_buffer)
    x = torch.cat([r["x"][0] for r in rows])
    own.stats.observe(x + 0.5)                  # fitted on other states than the scored ones
    own.refit(x + 0.5, torch.cat([torch.full((r["x"].shape[1],), float(e["reward"]))
                            for r, e in zip(rows, eps)]))
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    save_file(own.state_dict(), ckpt / "value_head.safetensors")
    batch = co.as_batch(eps, torch.device("cpu"), 0)
    scorer = copy.deepcopy(own)                 # as score_batch: observe the batch, then score
    scorer.stats.observe(x)
    with torch.no_grad():
        v_turn = torch.stack([scorer(r["x"][0]) for r in rows])                 # (B, K)
    values = mpo_spread(v_turn, batch["turn_ids"])
    saved = {"ids": batch["ids"], "attn": batch["attn"], "turn_ids": batch["turn_ids"],
             "scores": torch.tensor([e["reward"] for e in eps]),
             "values": {f"{tmp_path / 'run'} step_000002": values}}
    torch.save(saved, tmp_path / "s.pt")
    argv = ["transfer", "--out", str(tmp_path), "--steps", "2", "--saved", str(tmp_path / "s.pt"),
            "--record", str(tmp_path / "r.json"), "--", "--questions_per_step", "1",
            "--n_rollouts", "4"]
    record = co.main(argv)
    rows_out = record["files"][str(tmp_path / "s.pt")]
    assert len(rows_out) == 3 and json.loads((tmp_path / "r.json").read_text()) == record
    mine = next(v for k, v in rows_out.items() if k.startswith(f"{tmp_path / 'run'} step_000002"))
    R = torch.tensor([e["reward"] for e in eps], dtype=torch.float64).repeat_interleave(3)
    assert mine["turns"] == 18 and mine["ev"] == pytest.approx(co.ev(v_turn.flatten().double(), R))
    saved["values"][f"{tmp_path / 'run'} step_000002"] = values + 0.5 * (batch["turn_ids"] >= 0)
    torch.save(saved, tmp_path / "s.pt")
    with pytest.raises(SystemExit, match="differs from its saved values"):
        co.main(argv)
    with pytest.raises(SystemExit):
        co.main(["transfer", "--out", str(tmp_path)])                    # no --saved


def mpo_spread(v_turn, turn_ids):
    import mpo
    return mpo.spread_turn_values(v_turn, turn_ids)
