"""Tests for search_env.py: the fictional KB, multi-hop questions, BM25 tool, Search-R1 protocol,
HotpotQA loader and scripted agents. No network; runs in about a second."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

import search_env as se

FIXTURE = Path(__file__).parent / "fixtures" / "hotpotqa_small.json"


@pytest.fixture(scope="module")
def dataset() -> tuple[se.Split, se.Split]:
    return se.make_dataset()  # 200 train / 50 val questions, hops 2-4, seed 0


def run(split: se.Split, policy_for, max_turns: int = 5) -> list[se.Episode]:
    search = se.BM25Search(split.docs, k=3)
    return [se.run_episode(se.SearchEnv(search, q, max_turns), policy_for(q))
            for q in split.questions]


# --- knowledge base and questions ---------------------------------------------------------------

def test_same_seed_gives_identical_kb_and_questions():
    a, b = se.make_knowledge_base(7), se.make_knowledge_base(7)
    assert a.docs == b.docs and a.titles == b.titles
    assert se.make_questions(a, 30, seed=3) == se.make_questions(b, 30, seed=3)
    assert se.make_dataset(seed=5) == se.make_dataset(seed=5)


def test_different_seed_gives_different_kb_and_questions():
    a, b = se.make_knowledge_base(7), se.make_knowledge_base(8)
    assert a.docs != b.docs
    qa, qb = se.make_questions(a, 30, seed=3), se.make_questions(a, 30, seed=4)
    assert [q.question for q in qa] != [q.question for q in qb]


def test_kb_sizes_unique_names_and_consistent_relations():
    kb = se.make_knowledge_base(0, n_people=20, n_organisations=6, n_cities=8, n_regions=3)
    assert Counter(e.kind for e in kb.entities.values()) == {
        "person": 20, "organisation": 6, "city": 8, "region": 3}
    assert len(kb.docs) == len(kb.titles) == 37
    words = [w for t in kb.titles for w in t.split() if w not in se._ORG_KINDS]
    assert len(words) == len(set(words))  # every name word used once, so names are unique
    for e in kb.entities.values():
        assert kb.docs[kb.doc_id(e.name)].startswith(se._capitalise(e.mention))
        for rel, obj in e.relations.items():
            assert kb.entities[obj].kind == se.RELATIONS[rel].obj
    for r in kb.names("region"):
        capital = kb.entities[r].relations["capital"]
        assert kb.entities[capital].relations["region"] == r
    mayors = [kb.entities[c].relations["mayor"] for c in kb.names("city")]
    assert len(set(mayors)) == 8


def test_train_and_val_kbs_share_no_names_or_docs(dataset):
    train, val = dataset
    assert not set(train.titles) & set(val.titles)
    assert not set(train.docs) & set(val.docs)
    train_words = {w for t in train.titles for w in t.split() if w not in se._ORG_KINDS}
    val_words = {w for t in val.titles for w in t.split() if w not in se._ORG_KINDS}
    assert not train_words & val_words
    assert {q.corpus_id for q in train.questions} == {"train"}
    assert {q.corpus_id for q in val.questions} == {"val"}
    assert all(q.answer in val.titles for q in val.questions)


def test_questions_need_between_min_and_max_hops(dataset):
    train, val = dataset
    questions = train.questions + val.questions
    assert (len(train.questions), len(val.questions)) == (200, 50)
    assert set(Counter(q.hops for q in val.questions)) == {2, 3, 4}
    assert set(Counter(q.hops for q in train.questions)) == {2, 3, 4}
    assert len({q.question for q in questions}) == 250
    for q in questions:
        assert 2 <= q.hops <= 4
        assert len(q.gold_queries) == len(q.gold_doc_ids) == len(q.relations) == q.hops
        assert q.gold_queries[0] in q.question  # the question names the start entity ...
        assert all(name not in q.question for name in q.gold_queries[1:] + (q.answer,))  # only
        assert q.answer not in q.gold_queries


def test_make_questions_respects_hop_range_and_rejects_bad_range():
    kb = se.make_knowledge_base(1)
    assert {q.hops for q in se.make_questions(kb, 12, min_hops=3, max_hops=3)} == {3}
    assert {q.hops for q in se.make_questions(kb, 12, min_hops=1, max_hops=2)} == {1, 2}
    with pytest.raises(ValueError, match="min_hops"):
        se.make_questions(kb, 5, min_hops=3, max_hops=2)


# --- search tool ----------------------------------------------------------------------------------

def test_exact_name_search_returns_own_document_first(dataset):
    _, val = dataset
    search = se.BM25Search(val.docs, k=3)
    for doc_id, title in enumerate(val.titles):
        assert search.search(title)[0] == val.docs[doc_id], title


def test_bm25_clamps_k_and_handles_empty_queries():
    docs = ["Tessaly is a city.", "Varnhold is a region. Tessaly lies in Varnhold."]
    search = se.BM25Search(docs, k=10)  # k > corpus size must not raise
    assert search.search("Tessaly") == [docs[0], docs[1]]
    assert search.search("Varnhold", k=50) == [docs[1]]  # zero-score documents are dropped
    assert search.search("") == []
    assert search.search("the of a") == []  # stopwords only
    assert search.search("zzzz") == []
    with pytest.raises(ValueError):
        se.BM25Search([])


# --- protocol -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("<search>Pella Moraq</search>", ("search", "Pella Moraq")),
    ("Look it up.\n<search>  Quillon Institute \n</search>", ("search", "Quillon Institute")),
    ("<answer>Tessaly</answer>", ("answer", "Tessaly")),
    ("<search>a</search> <answer>b</answer>", ("malformed", "both <search> and <answer>")),
    ("<search></search>", ("malformed", "empty <search>")),
    ("<answer>   </answer>", ("malformed", "empty <answer>")),
    ("<search>a</search><search>b</search>", ("malformed", "more than one <search>")),
    ("The answer is Tessaly.", ("malformed", "neither <search> nor <answer>")),
    ("<search>unclosed", ("malformed", "neither <search> nor <answer>")),
    ("", ("malformed", "neither <search> nor <answer>")),
])
def test_parse_action(text, expected):
    assert se.parse_action(text) == expected


def test_normalisation_exact_match_and_f1_on_known_strings():
    assert se.normalize_answer("  The Quillon   Institute!! ") == "quillon institute"
    assert se.normalize_answer("An apple, a pear") == "apple pear"
    assert se.exact_match("the Quillon Institute.", "Quillon Institute") == 1.0
    assert se.exact_match("Quillon", "Quillon Institute") == 0.0
    assert se.f1_score("Quillon", "Quillon Institute") == pytest.approx(2 / 3)
    assert se.f1_score("the Quillon Guild", "Quillon Institute") == pytest.approx(0.5)
    assert se.f1_score("Tessaly", "Varnhold") == 0.0
    assert se.f1_score("", "") == 1.0 and se.f1_score("", "x") == 0.0


def test_initial_messages_and_observation_format(dataset):
    _, val = dataset
    q = val.questions[0]
    env = se.SearchEnv(se.BM25Search(val.docs, k=2), q)
    messages = env.reset()
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == se.SYSTEM_PROMPT and q.question in messages[1]["content"]
    step = env.step(f"<search>{q.gold_queries[0]}</search>")
    assert not step.done and step.reward == 0.0
    assert step.observation.startswith("<information>Doc 1: ")
    assert step.observation.endswith("</information>") and "\nDoc 2: " in step.observation
    assert val.docs[q.gold_doc_ids[0]] in step.observation
    no_hits = env.step("<search>the of</search>").observation
    assert no_hits == "<information>No results.</information>"


@pytest.mark.parametrize("text", ["no tags at all", "<search></search>",
                                  "<search>x</search><answer>y</answer>"])
def test_malformed_turn_ends_episode_with_zero_reward(dataset, text):
    _, val = dataset
    q = val.questions[0]
    env = se.SearchEnv(se.BM25Search(val.docs), q)
    env.reset()
    env.step(f"<search>{q.gold_queries[0]}</search>")
    result = env.step(text + f" {q.answer}")
    assert (result.done, result.reward, result.observation) == (True, 0.0, None)
    assert result.info["malformed"] is True and result.info["f1"] == 0.0
    with pytest.raises(RuntimeError):
        env.step(f"<answer>{q.answer}</answer>")


def test_answer_ends_episode_with_exact_match_reward_and_f1(dataset):
    _, val = dataset
    q = next(q for q in val.questions if q.relations[-1] in ("employer", "founder", "mentor"))
    env = se.SearchEnv(se.BM25Search(val.docs), q)
    env.reset()
    right = env.step(f"<answer>the {q.answer.upper()}.</answer>")  # normalised EM
    assert (right.done, right.reward, right.info["em"], right.info["f1"]) == (True, 1.0, 1.0, 1.0)
    env.reset()
    partial = env.step(f"<answer>{q.answer.split()[0]}</answer>")  # one of two words
    assert partial.reward == 0.0 and partial.info["f1"] == pytest.approx(2 / 3)
    assert partial.info["malformed"] is False and partial.info["turns"] == 1


def test_turn_limit_ends_episode_with_zero_reward(dataset):
    _, val = dataset
    q = next(q for q in val.questions if q.hops == 3)
    env = se.SearchEnv(se.BM25Search(val.docs), q, max_turns=3)
    env.reset()
    results = [env.step(t) for t in se.oracle_policy(q)[:3]]  # three searches, no room to answer
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].reward == 0.0 and results[-1].info["truncated"] is True
    assert results[-1].info["turns"] == 3
    episode = se.run_episode(env, se.scripted_policy(se.oracle_policy(q)))  # 4 turns > 3
    assert episode.reward == 0.0 and episode.info["truncated"]
    default = se.run_episode(se.SearchEnv(env.search, q), se.scripted_policy(se.oracle_policy(q)))
    assert default.reward == 1.0 and default.info["turns"] == 4


# --- scripted agents ------------------------------------------------------------------------------

def test_reading_oracle_solves_validation_questions(dataset):
    _, val = dataset
    episodes = run(val, se.reading_oracle)
    solved = sum(e.reward for e in episodes) / len(episodes)
    assert solved >= 0.95
    for q, e in zip(val.questions, episodes):  # it took exactly one search per hop
        assert e.info["turns"] == q.hops + 1


def test_reading_oracle_reads_documents_not_the_gold_answer(dataset):
    """Searching the wrong corpus (train docs for val questions) must make the oracle fail: it
    can only answer what the retrieved documents say."""
    train, val = dataset
    wrong = se.Split("val", val.questions, train.docs, train.titles)
    assert sum(e.reward for e in run(wrong, se.reading_oracle)) == 0.0


def test_gold_turns_replayed_score_one(dataset):
    _, val = dataset
    episodes = run(val, lambda q: se.scripted_policy(se.oracle_policy(q)))
    assert [e.reward for e in episodes] == [1.0] * 50


def test_random_query_agent_rarely_solves(dataset):
    _, val = dataset
    rng = random.Random(0)
    words = sorted({w.strip(".") for d in val.docs for w in d.split()})
    episodes = run(val, lambda q: se.random_query_policy(rng, words, val.titles))
    assert all(e.info["turns"] == 3 for e in episodes)
    assert sum(e.reward for e in episodes) / len(episodes) <= 0.10


def test_custom_environment_plugs_into_run_episode():
    """The interface in the module docstring: any reset/step object drives run_episode."""

    class CalculatorEnv:
        def reset(self, task=None):
            return [{"role": "user", "content": "What is 6 * 7?"}]

        def step(self, text):
            if text.startswith("<calc>"):
                return se.StepResult("<result>42</result>", False, 0.0, {})
            kind, arg = se.parse_action(text)
            return se.StepResult(None, True, se.exact_match(arg, "42"), {})

    turns = ["<calc>6*7</calc>", "<answer>42</answer>"]
    episode = se.run_episode(CalculatorEnv(), se.scripted_policy(turns))
    assert episode.reward == 1.0
    chat = [m["content"] for m in episode.messages[1:]]
    assert chat == [turns[0], "<result>42</result>", turns[1]]


# --- HotpotQA -------------------------------------------------------------------------------------

def to_original_format(record: dict) -> dict:
    """The HF layout -> the original HotpotQA JSON layout (list of [title, sentences])."""
    ctx, sup = record["context"], record["supporting_facts"]
    return {"_id": record["id"], "question": record["question"], "answer": record["answer"],
            "supporting_facts": [list(p) for p in zip(sup["title"], sup["sent_id"])],
            "context": [list(p) for p in zip(ctx["title"], ctx["sentences"])]}


def test_hotpotqa_loader_reads_hf_format_fixture():
    split = se.load_hotpotqa("validation", path=FIXTURE)
    assert split.name == "hotpotqa-validation" and len(split.questions) == 6
    assert len(split.docs) == 18  # 19 paragraphs, one shared by two questions
    assert split.docs[0] == ("Marlowe Clock Museum: The Marlowe Clock Museum is a museum of "
                             "timepieces in Dunhaven. It opened in 1911.")
    q = split.questions[1]
    assert (q.id, q.answer, q.hops) == ("fx0002", "Ansel Kirby", 2)
    assert q.gold_queries == ("Velmora", "Song of the Lowlands")
    assert [split.titles[i] for i in q.gold_doc_ids] == list(q.gold_queries)
    assert split.questions[2].gold_doc_ids[0] == split.questions[0].gold_doc_ids[0] == 0
    search = se.BM25Search(split.docs, k=3)
    assert search.search("Velmora")[0] == split.docs[q.gold_doc_ids[0]]
    assert len(se.load_hotpotqa(path=FIXTURE, n=2).questions) == 2


def test_hotpotqa_loader_reads_original_format(tmp_path):
    records = json.loads(FIXTURE.read_text())
    path = tmp_path / "hotpot_dev_distractor.json"
    path.write_text(json.dumps([to_original_format(r) for r in records]))
    assert se.load_hotpotqa(path=path) == se.load_hotpotqa(path=FIXTURE)


def test_hotpotqa_loader_rejects_malformed_files(tmp_path):
    records = json.loads(FIXTURE.read_text())
    del records[3]["context"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(records))
    with pytest.raises(ValueError, match="record 3.*context"):
        se.load_hotpotqa(path=bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        se.load_hotpotqa(path=bad)
    bad.write_text(json.dumps({"data": records}))
    with pytest.raises(ValueError, match="JSON list"):
        se.load_hotpotqa(path=bad)


def test_hotpotqa_without_datasets_raises_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match="pip install datasets"):
        se.load_hotpotqa("validation", n=5)


def test_warm_start_episodes_never_rehearse_a_training_question():
    train, val = se.make_dataset(n_train=20, n_val=5, min_hops=1, max_hops=2, seed=3,
                                         n_people=24, n_organisations=8, n_cities=6, n_regions=3)
    make_env = se.env_factory((train, val), top_k=1, max_turns=3)
    episodes = se.scripted_episodes(train, make_env, 30, 1, 2, seed=3)
    asked = [next(m["content"] for m in e if m["role"] == "user") for e in episodes]
    trained = [se.user_message(q) for q in train.questions]
    assert len(episodes) == 30 and len(set(asked)) == 30
    assert not set(asked) & set(trained)
    assert all(e[-1]["role"] == "assistant" and "<answer>" in e[-1]["content"] for e in episodes)
    # a knowledge base with too few questions left gives what it has; none left is an error
    small, _ = se.make_dataset(n_train=5, n_val=1, min_hops=1, max_hops=1, seed=0,
                                       n_people=4, n_organisations=2, n_cities=2, n_regions=1)
    n_all = len(se.make_questions(small.kb, 1000, 1, 1, strict=False))
    few = se.scripted_episodes(small, se.env_factory((small,), 1, 3), 1000, 1, 1)
    assert len(few) == n_all - 5
    everything, _ = se.make_dataset(n_train=n_all, n_val=1, min_hops=1, max_hops=1,
                                            seed=0, n_people=4, n_organisations=2, n_cities=2,
                                            n_regions=1)
    with pytest.raises(ValueError, match="no question left for a warm start"):
        se.scripted_episodes(everything, se.env_factory((everything,), 1, 3),
                                     10, 1, 1)


def test_explaining_oracle_writes_a_reasoning_line_before_the_same_actions():
    train, val = se.make_dataset(n_train=30, n_val=5, min_hops=2, max_hops=3, seed=1)
    make_env = se.env_factory((train, val), top_k=1, max_turns=5)
    for q in train.questions:
        plain = se.run_episode(make_env(q), se.reading_oracle(q))
        told = se.run_episode(make_env(q), se.reading_oracle(q, explain=True))
        turns = [m["content"] for m in told.messages if m["role"] == "assistant"]
        assert [se.parse_action(t) for t in turns] == [
            se.parse_action(m["content"]) for m in plain.messages if m["role"] == "assistant"]
        assert told.reward == plain.reward
        for t in turns:                                   # "<line>\n<search>..." or "\n<answer>"
            line, action = t.split("\n")
            assert len(line.split()) >= 8 and action.startswith(("<search>", "<answer>"))
        assert q.gold_queries[0] in turns[0].split("\n")[0]
    solved = [se.run_episode(make_env(q), se.reading_oracle(q, True)).reward for q in train.questions]
    assert sum(solved) >= 0.9 * len(solved)
