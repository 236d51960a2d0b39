"""A multi-turn search environment for Search-R1-style agents, with no downloads.

MPO is about credit assignment across the turns of a long-horizon agent, so it needs a task where
an episode genuinely takes several turns and success depends on every one of them. This file
gives one that runs anywhere:

1. a deterministic generator of a *fictional* knowledge base (people, organisations, cities,
   regions, named from invented syllables so a model cannot answer from memory), one short
   document per entity;
2. multi-hop questions whose answer needs 2-4 searches, each search naming the entity that the
   previous document revealed (``make_questions``, ``make_dataset``);
3. a BM25 search tool (``BM25Search``, the ``bm25s`` library);
4. the Search-R1 protocol (``SearchEnv``): the assistant writes ``<search>query</search>`` or
   ``<answer>text</answer>``; the environment answers a search with
   ``<information>Doc 1: ...</information>`` as the next user message; the episode ends at an
   answer (reward = normalised exact match, F1 in ``info``), at the turn limit, or on a malformed
   turn (reward 0);
5. a HotpotQA loader (``load_hotpotqa``) that builds the same kind of ``Split`` from real data;
6. scripted agents (``oracle_policy``, ``reading_oracle``, ``random_query_policy``) for tests.
7. a trainer's task in four calls (``make_splits``, ``env_factory``, ``scripted_episodes``,
   ``tokenizer_corpus``): the splits, an environment per question, warm-start episodes; or in
   one, ``search_suite``: the ``Suite`` train_min.py runs (its presets bring their own).

The environment interface
-------------------------
Anything with these two methods can drive a rollout (``run_episode`` uses nothing else)::

    reset(task=None) -> list[dict]        # chat messages to start from: system + user
    step(assistant_text) -> StepResult    # (observation: str | None, done, reward, info)

``observation`` is the next user message (``None`` when the episode is over). To plug in your own
tool, write a class with these two methods, e.g. a calculator::

    class CalculatorEnv:
        def __init__(self, question: str, answer: str):
            self.question, self.answer = question, answer

        def reset(self, task=None):
            rules = "Use <calc>1+2</calc> to compute, then <answer>3</answer>."
            return [{"role": "system", "content": rules},
                    {"role": "user", "content": self.question}]

        def step(self, text):
            if m := re.search(r"<calc>([\\d+*/(). -]+)</calc>", text):  # digits, operators
                return StepResult(f"<result>{eval(m[1])}</result>", False, 0.0, {})
            kind, arg = parse_action(text)
            reward = exact_match(arg, self.answer) if kind == "answer" else 0.0
            return StepResult(None, True, reward, {"malformed": kind == "malformed"})
"""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import bm25s

Message = dict[str, str]
Policy = Callable[[list[Message]], str]  # the chat so far -> the next assistant turn

# --------------------------------------------------------------------------------------------
# Fictional knowledge base
# --------------------------------------------------------------------------------------------

# Syllables for invented names; two per word gives ~10^6 words, far more than a KB needs.
_ONSETS = ["b", "br", "d", "dr", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "sh", "t",
           "th", "v", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
_CODAS = ["", "", "", "l", "n", "r", "s", "m", "q", "th"]

_OCCUPATIONS = ["researcher", "painter", "engineer", "physician", "archivist", "cartographer",
                "composer", "botanist", "sculptor", "astronomer", "translator", "architect"]
_ORG_KINDS = ["Institute", "Foundation", "Company", "Guild", "Academy", "Observatory", "Society",
              "Trust", "Collective", "Workshop"]


@dataclass(frozen=True)
class Relation:
    """One edge type: how a document states it, and how a question refers to it."""

    subject: str  # entity kind that has this relation: person / organisation / city / region
    obj: str  # entity kind it points to
    sentence: str  # document sentence, "{s}" = subject mention, "{o}" = object mention
    phrase: str  # noun phrase nesting a previous hop, "{x}" = that hop's phrase
    question: str  # the outermost question when this is the last hop


# The relation table is the whole "schema": documents, questions and the reading oracle use it.
RELATIONS: dict[str, Relation] = {
    "birthplace": Relation("person", "city", "{s} was born in {o}.",
                           "the birthplace of {x}", "In which city was {x} born?"),
    "employer": Relation("person", "organisation", "{s} works at {o}.",
                         "the employer of {x}", "Which organisation employs {x}?"),
    "mentor": Relation("person", "person", "{s} was mentored by {o}.",
                       "the mentor of {x}", "Who mentored {x}?"),
    "founder": Relation("organisation", "person", "{s} was founded by {o}.",
                        "the founder of {x}", "Who founded {x}?"),
    "headquarters": Relation("organisation", "city", "{s} is headquartered in {o}.",
                             "the headquarters city of {x}", "In which city is {x} headquartered?"),
    "region": Relation("city", "region", "{s} lies in the region of {o}.",
                       "the region of {x}", "In which region is {x} located?"),
    "mayor": Relation("city", "person", "The mayor of {s} is {o}.",
                      "the mayor of {x}", "Who is the mayor of {x}?"),
    "capital": Relation("region", "city", "The capital of {s} is {o}.",
                        "the capital of {x}", "What is the capital of {x}?"),
}

# Words of the system prompt's example: never generated, so the example cannot leak an answer.
_RESERVED = {"ilvar", "dunmoth", "quessa", "brannock", "teloria"}


@dataclass
class Entity:
    name: str  # unique within a KB; what an agent should search for
    kind: str  # person / organisation / city / region
    description: str  # first sentence: "is a painter", "is an organisation"
    relations: dict[str, str] = field(default_factory=dict)  # relation -> object entity name

    @property
    def mention(self) -> str:
        """How text names the entity; organisations take an article ("the Quillon Institute")."""
        return f"the {self.name}" if self.kind == "organisation" else self.name


@dataclass
class KnowledgeBase:
    """Entities and their documents; ``docs[i]`` describes ``entities[titles[i]]``."""

    docs: list[str]
    titles: list[str]
    entities: dict[str, Entity]
    seed: int

    def doc_id(self, name: str) -> int:
        return self.titles.index(name)

    def names(self, kind: str | None = None) -> list[str]:
        return [n for n, e in self.entities.items() if kind is None or e.kind == kind]


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


def _render_doc(entity: Entity, entities: dict[str, Entity]) -> str:
    """One document per entity. Every sentence names the entity, so BM25 ranks an entity's own
    document first when its exact name is searched (others mention the name at most once)."""
    sentences = [f"{_capitalise(entity.mention)} {entity.description}."]
    for rel, obj in entity.relations.items():
        line = RELATIONS[rel].sentence.format(s=entity.mention, o=entities[obj].mention)
        sentences.append(_capitalise(line))
    return " ".join(sentences)


def _name_words(rng: random.Random, n: int, taken: set[str]) -> list[str]:
    """``n`` new capitalised words of two syllables, none in ``taken`` (which is updated).

    Every word is used once per KB, so an entity's name tokens appear only in its own document and
    in the documents that point at it; that is what makes exact-name search unambiguous."""
    stop = set(bm25s.stopwords.STOPWORDS_EN) | _RESERVED
    words: list[str] = []
    while len(words) < n:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(2))
        if len(word) >= 4 and word not in taken and word not in stop:
            taken.add(word)
            words.append(word.capitalize())
    return words


def make_knowledge_base(seed: int, n_people: int = 60, n_organisations: int = 15,
                        n_cities: int = 15, n_regions: int = 5,
                        exclude: set[str] | frozenset[str] = frozenset()) -> KnowledgeBase:
    """Generate a fictional KB; the same arguments give byte-identical documents.

    ``exclude`` holds lower-case name words another KB already uses (``make_dataset`` passes the
    training KB's words so the validation KB shares no name with it). Every relation in
    ``RELATIONS`` is filled for every entity of its subject kind; each region contains at least one
    city and its capital lies in it; each city has a different mayor.
    """
    if min(n_people, n_organisations, n_cities, n_regions) < 1 or n_people < max(n_cities, 2):
        raise ValueError("need >= 1 of each kind and n_people >= max(n_cities, 2)")
    rng = random.Random(seed)
    taken = {w.lower() for w in exclude}
    regions = _name_words(rng, n_regions, taken)
    cities = _name_words(rng, n_cities, taken)
    orgs = [f"{w} {rng.choice(_ORG_KINDS)}" for w in _name_words(rng, n_organisations, taken)]
    people = [" ".join(p) for p in zip(*[iter(_name_words(rng, 2 * n_people, taken))] * 2)]

    ents: dict[str, Entity] = {}
    for p in people:
        job = rng.choice(_OCCUPATIONS)
        ents[p] = Entity(p, "person", f"is {'an' if job[0] in 'aeiou' else 'a'} {job}")
    for o in orgs:
        ents[o] = Entity(o, "organisation", "is an organisation")
    for c in cities:
        ents[c] = Entity(c, "city", "is a city")
    for r in regions:
        ents[r] = Entity(r, "region", "is a region")

    # The first n_regions cities go one per region, so every region has a city (and a capital).
    city_region = {c: regions[i] if i < n_regions else rng.choice(regions)
                   for i, c in enumerate(cities)}
    mayors = rng.sample(people, n_cities)
    for p in people:
        ents[p].relations = {"birthplace": rng.choice(cities), "employer": rng.choice(orgs),
                             "mentor": rng.choice([q for q in people if q != p])}
    for o in orgs:
        ents[o].relations = {"founder": rng.choice(people), "headquarters": rng.choice(cities)}
    for c, mayor in zip(cities, mayors):
        ents[c].relations = {"region": city_region[c], "mayor": mayor}
    for r in regions:
        ents[r].relations = {"capital": rng.choice([c for c in cities if city_region[c] == r])}

    titles = list(ents)
    docs = [_render_doc(ents[t], ents) for t in titles]
    return KnowledgeBase(docs=docs, titles=titles, entities=ents, seed=seed)


# --------------------------------------------------------------------------------------------
# Multi-hop questions
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Question:
    """A task: ask ``question``, expect ``answer``; searched in the corpus named ``corpus_id``."""

    question: str
    answer: str
    hops: int  # searches an oracle needs
    gold_queries: tuple[str, ...]  # the entity names an oracle searches, in order
    gold_doc_ids: tuple[int, ...]  # the documents those searches should return first
    corpus_id: str  # name of the Split whose docs hold the answer
    relations: tuple[str, ...] = ()  # relation of each hop (synthetic questions only)
    id: str = ""


@dataclass
class Split:
    """Questions plus the corpus they are searched in (``BM25Search(split.docs)``)."""

    name: str
    questions: list[Question]
    docs: list[str]
    titles: list[str]
    kb: KnowledgeBase | None = None


def _question_text(start: Entity, relations: Sequence[str]) -> str:
    """Nest noun phrases inward-out: hops (mentor, employer) from P read
    "Which organisation employs the mentor of P?"."""
    phrase = start.mention
    for rel in relations[:-1]:
        phrase = RELATIONS[rel].phrase.format(x=phrase)
    return _capitalise(RELATIONS[relations[-1]].question.format(x=phrase))


def _sample_chain(kb: KnowledgeBase, rng: random.Random,
                  hops: int) -> tuple[str, list[tuple[str, str]]] | None:
    """A random walk of ``hops`` relations from a random entity, never revisiting an entity (so the
    answer is never the start and no hop can be skipped). Returns (start, [(relation, object)])."""
    start = current = rng.choice(kb.titles)
    visited, chain = {current}, []
    for _ in range(hops):
        options = [(r, o) for r, o in kb.entities[current].relations.items() if o not in visited]
        if not options:
            return None
        rel, current = rng.choice(options)
        visited.add(current)
        chain.append((rel, current))
    return start, chain


def _chain_question(kb: KnowledgeBase, start: str, chain: list[tuple[str, str]],
                    corpus_id: str, index: int) -> Question:
    rels = tuple(r for r, _ in chain)
    path = [start] + [o for _, o in chain]  # start, hop 1 object, ..., answer
    return Question(
        question=_question_text(kb.entities[start], rels),
        answer=path[-1],
        hops=len(chain),
        gold_queries=tuple(path[:-1]),
        gold_doc_ids=tuple(kb.doc_id(n) for n in path[:-1]),
        corpus_id=corpus_id,
        relations=rels,
        id=f"{corpus_id}-{index}",
    )


def make_questions(kb: KnowledgeBase, n: int, min_hops: int = 2, max_hops: int = 4,
                   seed: int = 0, corpus_id: str = "kb", strict: bool = True) -> list[Question]:
    """``n`` distinct questions; hop counts cycle min_hops..max_hops so each is equally common.
    A knowledge base too small for ``n`` raises, or with ``strict=False`` gives what it has.

    Example (3 hops, mentor -> employer -> headquarters): "In which city is the employer of the
    mentor of Pella Moraq headquartered?", gold_queries = (Pella Moraq, <mentor>, <employer>).
    """
    if not 1 <= min_hops <= max_hops:
        raise ValueError(f"need 1 <= min_hops <= max_hops, got {min_hops}, {max_hops}")
    rng = random.Random(seed)
    questions: list[Question] = []
    seen: set[str] = set()
    for _ in range(100 * n + 1000):  # walks can dead-end or repeat; give up eventually
        if len(questions) == n:
            break
        walk = _sample_chain(kb, rng, hops=min_hops + len(questions) % (max_hops - min_hops + 1))
        if walk is None:
            continue
        q = _chain_question(kb, *walk, corpus_id, len(questions))
        if q.question not in seen:
            seen.add(q.question)
            questions.append(q)
    if strict and len(questions) < n:
        raise ValueError(f"could only make {len(questions)} distinct questions; enlarge the KB")
    return questions


def make_dataset(n_train: int = 200, n_val: int = 50, min_hops: int = 2, max_hops: int = 4,
                 seed: int = 0, **kb_sizes: int) -> tuple[Split, Split]:
    """Train and validation splits over two *disjoint* KBs (no shared name word, hence no shared
    entity or document), so validation measures searching, not memorising the training world.

    ``kb_sizes`` go to ``make_knowledge_base`` (n_people, n_organisations, n_cities, n_regions).
    """
    train_kb = make_knowledge_base(2 * seed, **kb_sizes)
    used = {w.lower() for t in train_kb.titles for w in t.split()}
    val_kb = make_knowledge_base(2 * seed + 1, exclude=used, **kb_sizes)
    splits = []
    for name, kb, n, offset in [("train", train_kb, n_train, 0), ("val", val_kb, n_val, 1)]:
        qs = make_questions(kb, n, min_hops, max_hops, seed=2 * seed + offset, corpus_id=name)
        splits.append(Split(name, qs, kb.docs, kb.titles, kb))
    return splits[0], splits[1]
# --------------------------------------------------------------------------------------------
# Search tool
# --------------------------------------------------------------------------------------------

class BM25Search:
    """Top-k BM25 retrieval over ``docs`` (bm25s, English stopwords, no stemming).

    >>> BM25Search(["Tessaly is a city.", "Varn is a region."], k=3).search("Tessaly")
    ['Tessaly is a city.']
    """

    def __init__(self, docs: Sequence[str], k: int = 3):
        if not docs:
            raise ValueError("BM25Search needs at least one document")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.docs, self.k = list(docs), k
        self._bm25 = bm25s.BM25()
        self._bm25.index(self._tokenize(self.docs), show_progress=False)

    @staticmethod
    def _tokenize(texts: list[str]) -> list[list[str]]:
        return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    def search(self, query: str, k: int | None = None) -> list[str]:
        """The top-k documents, best first. Documents sharing no term with the query (score 0)
        are dropped rather than returned in arbitrary order: an empty query gives []."""
        tokens = self._tokenize([query])
        if not tokens[0]:
            return []
        k = min(k or self.k, len(self.docs))  # bm25s raises when k exceeds the corpus size
        ids, scores = self._bm25.retrieve(tokens, k=k, show_progress=False)
        return [self.docs[i] for i, s in zip(ids[0], scores[0]) if s > 0]


# --------------------------------------------------------------------------------------------
# Protocol: prompt, parsing, scoring
# --------------------------------------------------------------------------------------------

SYSTEM_PROMPT = """\
Answer the question by searching a knowledge base. In each turn, think briefly if you like, then \
write exactly one of:
<search>query</search> to search; the top results come back as <information>...</information>.
<answer>name</answer> to give the final answer (just the name, no explanation).
Search for one name at a time: each document tells you the name to search for next.

Example:
Question: Who founded the employer of Ilvar Dunmoth?
<search>Ilvar Dunmoth</search>
<information>Doc 1: Ilvar Dunmoth is a painter. Ilvar Dunmoth works at the Quessa \
Guild.</information>
<search>Quessa Guild</search>
<information>Doc 1: The Quessa Guild is an organisation. The Quessa Guild was founded by \
Brannock Teloria.</information>
<answer>Brannock Teloria</answer>"""

# For small models (the smol preset): no worked example, ~36 tokens instead of ~200. A 135M model
# does not follow either zero-shot; its warm start teaches the protocol (presets.py).
SHORT_SYSTEM_PROMPT = ("Answer the question by searching. Write <search>name</search> to look up "
                       "a name; results come back in <information>. Then write "
                       "<answer>name</answer>.")


# The multi-hop smol preset: the short prompt, asking for one line of reasoning before each action.
REASONING_SYSTEM_PROMPT = ("Answer the question by searching. In each turn, first write one line "
                           "saying what you found and what you need next, then "
                           "<search>name</search> to look up a name; results come back in "
                           "<information>. When you have the answer, write <answer>name</answer>.")


def user_message(question: Question) -> str:
    """The first user turn."""
    return f"Question: {question.question}"


def initial_messages(question: Question, system_prompt: str = SYSTEM_PROMPT) -> list[Message]:
    return [{"role": "system", "content": system_prompt},
            {"role": "user", "content": user_message(question)}]


_TAG = {tag: re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL) for tag in ("search", "answer")}


def parse_action(text: str) -> tuple[str, str]:
    """Read one assistant turn: ("search", query), ("answer", text) or ("malformed", reason).

    >>> parse_action("I need X. <search> X </search>")
    ('search', 'X')
    >>> parse_action("<search>a</search><answer>b</answer>")
    ('malformed', 'both <search> and <answer>')
    """
    found = {tag: pat.findall(text) for tag, pat in _TAG.items()}
    if found["search"] and found["answer"]:
        return "malformed", "both <search> and <answer>"
    for tag in ("search", "answer"):
        if len(found[tag]) > 1:
            return "malformed", f"more than one <{tag}>"
        if found[tag]:
            content = found[tag][0].strip()
            return (tag, content) if content else ("malformed", f"empty <{tag}>")
    return "malformed", "neither <search> nor <answer>"


def format_information(docs: Sequence[str]) -> str:
    """The observation for a search: numbered documents, one per line."""
    body = "\n".join(f"Doc {i}: {d}" for i, d in enumerate(docs, 1)) or "No results."
    return f"<information>{body}</information>"


_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation, drop articles, collapse whitespace.

    >>> normalize_answer("The  Quessa Guild!")
    'quessa guild'
    """
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """SQuAD token F1 between normalised strings (1.0 when both are empty)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------

@dataclass
class StepResult:
    observation: str | None  # the next user message; None once the episode is over
    done: bool
    reward: float
    info: dict[str, Any]


class Environment(Protocol):
    """What a rollout needs from a tool environment (see the module docstring)."""

    def reset(self, task: Any = None) -> list[Message]: ...

    def step(self, assistant_text: str) -> StepResult: ...


class SearchEnv:
    """One Search-R1 episode: search turns until an answer, a malformed turn or ``max_turns``.

    ``max_turns`` counts assistant turns; the default 5 allows 4 searches and an answer, enough for
    the longest (4-hop) question. A search on the last allowed turn ends the episode with reward 0
    (``info["truncated"]``). Terminal ``info`` always holds em, f1, malformed, truncated, turns.
    """

    def __init__(self, search: BM25Search, question: Question | None = None, max_turns: int = 5,
                 system_prompt: str = SYSTEM_PROMPT):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.search, self.question, self.max_turns = search, question, max_turns
        self.system_prompt = system_prompt
        self.turns, self.done = 0, True

    def reset(self, task: Question | None = None) -> list[Message]:
        """Start an episode on ``task`` (or on the question given at construction)."""
        self.question = task or self.question
        if self.question is None:
            raise ValueError("SearchEnv.reset needs a question")
        self.turns, self.done = 0, False
        return initial_messages(self.question, self.system_prompt)

    def step(self, assistant_text: str) -> StepResult:
        if self.done:
            raise RuntimeError("the episode is over; call reset()")
        self.turns += 1
        kind, arg = parse_action(assistant_text)
        if kind == "malformed":
            return self._end(answer="", malformed=True, reason=arg)
        if kind == "answer":
            return self._end(answer=arg)
        if self.turns >= self.max_turns:
            return self._end(answer="", truncated=True)
        obs = format_information(self.search.search(arg))
        return StepResult(obs, False, 0.0, {"turns": self.turns, "query": arg})

    def _end(self, answer: str, malformed: bool = False, truncated: bool = False,
             reason: str = "") -> StepResult:
        self.done = True
        scored = not (malformed or truncated)
        em = exact_match(answer, self.question.answer) if scored else 0.0
        f1 = f1_score(answer, self.question.answer) if scored else 0.0
        info = {"em": em, "f1": f1, "malformed": malformed, "truncated": truncated,
                "turns": self.turns, "answer": answer, "reason": reason}
        return StepResult(None, True, em, info)


@dataclass
class Episode:
    messages: list[Message]  # system, user, then alternating assistant / user (observations)
    reward: float
    info: dict[str, Any]


def run_episode(env: Environment, policy: Policy, task: Any = None) -> Episode:
    """Roll one episode: the policy sees the whole chat and returns the next assistant text."""
    messages = env.reset(task)
    while True:
        text = policy(messages)
        messages.append({"role": "assistant", "content": text})
        result = env.step(text)
        if result.done:
            return Episode(messages, result.reward, result.info)
        messages.append({"role": "user", "content": result.observation or ""})


# --------------------------------------------------------------------------------------------
# HotpotQA
# --------------------------------------------------------------------------------------------

def _pairs(value: Any, keys: tuple[str, str]) -> list[tuple[Any, Any]]:
    """HF stores context / supporting_facts as {"title": [...], "sentences": [...]}; the original
    JSON as [[title, sentences], ...]. Return [(title, x), ...] for either."""
    if isinstance(value, dict):
        return list(zip(value[keys[0]], value[keys[1]], strict=True))
    return [(pair[0], pair[1]) for pair in value]


def _hotpot_split(records: list[dict[str, Any]], name: str) -> Split:
    """One document per distinct paragraph ("Title: sentences"), shared by all questions."""
    docs: list[str] = []
    titles: list[str] = []
    doc_ids: dict[tuple[str, str], int] = {}
    questions: list[Question] = []
    for i, rec in enumerate(records):
        try:
            paragraphs = _pairs(rec["context"], ("title", "sentences"))
            support = _pairs(rec.get("supporting_facts") or [], ("title", "sent_id"))
            text = {t: " ".join(" ".join(s).split()) for t, s in paragraphs}
            question, answer, qid = rec["question"], rec["answer"], rec.get("id", rec.get("_id"))
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise ValueError(f"HotpotQA record {i} is malformed ({type(err).__name__}: {err}); "
                             "expected question, answer and context") from err
        ids = {}
        for title, body in text.items():
            key = (title, body)
            if key not in doc_ids:
                doc_ids[key] = len(docs)
                docs.append(f"{title}: {body}")
                titles.append(title)
            ids[title] = doc_ids[key]
        gold = tuple(dict.fromkeys(t for t, _ in support if t in ids))
        questions.append(Question(question=question, answer=answer, hops=max(1, len(gold)),
                                  gold_queries=gold, gold_doc_ids=tuple(ids[t] for t in gold),
                                  corpus_id=name, id=str(qid if qid is not None else i)))
    return Split(name, questions, docs, titles)


def load_hotpotqa(split: str = "validation", n: int | None = None,
                  path: str | Path | None = None, skip: int = 0) -> Split:
    """HotpotQA (distractor setting) as a ``Split``: its questions, and a corpus of all their
    paragraphs (10 per question, 2 of them gold), searched with ``BM25Search(split.docs)``.

    With ``path``, read a local JSON list in the HF ``hotpot_qa`` "distractor" layout or the
    original one (``_id``, context as [[title, sentences], ...]); otherwise download it with
    ``datasets``. Keeps records ``skip`` .. ``skip + n`` (all from ``skip`` if n is None), so one
    local file can give disjoint train and validation splits.
    """
    if path is not None:
        try:
            records = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from err
        if not isinstance(records, list):
            raise ValueError(f"{path}: expected a JSON list of HotpotQA records")
    else:
        try:
            import datasets  # only this path needs it
        except ImportError:
            raise ImportError("load_hotpotqa without path= needs the `datasets` package: "
                              "pip install datasets (or pass path= to a local JSON file)") from None
        # The hub's current id for what older code loads as "hotpot_qa" (which redirects there).
        records = datasets.load_dataset("hotpotqa/hotpot_qa", "distractor", split=split)
        stop = len(records) if n is None else min(skip + n, len(records))
        records = records.select(range(min(skip, stop), stop))
        skip = 0
    records = list(records)[skip:]
    return _hotpot_split(records[:n] if n is not None else records, name=f"hotpotqa-{split}")


# --------------------------------------------------------------------------------------------
# Scripted agents (for tests and sanity checks)
# --------------------------------------------------------------------------------------------

def oracle_policy(question: Question) -> list[str]:
    """The exact turns of a perfect agent: search each gold query, then answer."""
    return [f"<search>{q}</search>" for q in question.gold_queries] + [
        f"<answer>{question.answer}</answer>"]


def scripted_policy(turns: Sequence[str]) -> Policy:
    """Replay fixed turns, one per assistant turn: ``scripted_policy(oracle_policy(q))``."""
    return lambda messages: turns[sum(m["role"] == "assistant" for m in messages)]


def _top_doc(observation: str) -> str:
    match = re.search(r"^(?:<information>)?Doc 1: (.*?)(?:</information>)?$", observation, re.M)
    return match.group(1) if match else ""


def _read_relation(doc: str, subject: str, relation: str) -> str | None:
    """Find "<subject> <relation sentence> <object>." in ``doc``; return the object's name."""
    rel = RELATIONS[relation]
    mention = f"the {subject}" if rel.subject == "organisation" else subject
    pattern = re.escape(_capitalise(rel.sentence.format(s=mention, o="\0"))).replace("\0", "(.+?)")
    match = re.search(pattern, doc)
    return re.sub(r"^the ", "", match.group(1)) if match else None


def reading_oracle(question: Question, explain: bool = False) -> Policy:
    """An agent that knows the question's relations and start entity but *reads* every answer off
    the top-1 document of its last search, as a model must. It fails if retrieval does.
    ``explain``: each turn opens with one line of reasoning (what was found, what comes next),
    e.g. "The employer of Pella Moraq is the Quessa Guild. Next I need the founder of the
    Quessa Guild.\n<search>Quessa Guild</search>": turns of ~20-40 tokens instead of ~8."""

    def phrase(relation: str, x: str) -> str:       # "the employer of Pella Moraq"
        mention = f"the {x}" if RELATIONS[relation].subject == "organisation" else x
        return RELATIONS[relation].phrase.format(x=mention)

    def policy(messages: list[Message]) -> str:
        turn = sum(m["role"] == "assistant" for m in messages)
        if turn == 0:
            start = question.gold_queries[0]
            why = f"I need {phrase(question.relations[0], start)}, so I look up {start}.\n"
            return (why if explain else "") + f"<search>{start}</search>"
        _, subject = parse_action(messages[-2]["content"])  # our previous search
        doc = _top_doc(messages[-1]["content"])  # the observation of that search
        relation = question.relations[turn - 1]
        found = _read_relation(doc, subject, relation)
        if found is None:
            why = f"The document does not say {phrase(relation, subject)}.\n"
            return (why if explain else "") + "<answer>unknown</answer>"
        said = f"{_capitalise(phrase(relation, subject))} is {found}."
        if turn == question.hops:
            return (f"{said} That answers the question.\n" if explain else "") + \
                f"<answer>{found}</answer>"
        nxt = f" Next I need {phrase(question.relations[turn], found)}.\n"
        return (said + nxt if explain else "") + f"<search>{found}</search>"

    return policy


def random_query_policy(rng: random.Random, words: Sequence[str], answers: Sequence[str],
                        n_searches: int = 2, words_per_query: int = 2) -> Policy:
    """A baseline that searches random ``words`` ``n_searches`` times, then answers a random
    element of ``answers`` (e.g. ``kb.names()``); it should almost never be right."""

    def policy(messages: list[Message]) -> str:
        if sum(m["role"] == "assistant" for m in messages) < n_searches:
            return f"<search>{' '.join(rng.choices(words, k=words_per_query))}</search>"
        return f"<answer>{rng.choice(answers)}</answer>"

    return policy


# --------------------------------------------------------------------------------------------
# A trainer's task: splits, environments, warm-start episodes, tokenizer text
# --------------------------------------------------------------------------------------------

def make_splits(dataset: str, n_train: int, n_val: int, min_hops: int = 2, max_hops: int = 4,
                seed: int = 0, hotpotqa_path: str = "",
                kb_sizes: dict[str, int] | None = None) -> tuple[Split, Split]:
    """Training and validation splits: "synthetic" (``make_dataset``: two disjoint knowledge bases
    of ``kb_sizes``, default ``make_knowledge_base``'s) or "hotpotqa" (the hub's train and
    validation splits; with ``hotpotqa_path`` one local file: n_train records, then n_val)."""
    if dataset == "hotpotqa" and hotpotqa_path:
        return (load_hotpotqa("train", n=n_train, path=hotpotqa_path),
                load_hotpotqa("validation", n=n_val, path=hotpotqa_path, skip=n_train))
    if dataset == "hotpotqa":
        return load_hotpotqa("train", n=n_train), load_hotpotqa("validation", n=n_val)
    if dataset == "synthetic":
        return make_dataset(n_train, n_val, min_hops, max_hops, seed=seed, **(kb_sizes or {}))
    raise ValueError(f"dataset must be 'synthetic' or 'hotpotqa', got {dataset!r}")


def env_factory(splits: Sequence[Split], top_k: int = 3, max_turns: int = 5,
                system_prompt: str = SYSTEM_PROMPT) -> Callable[[Question], SearchEnv]:
    """question -> a ``SearchEnv`` searching its own split's corpus (``question.corpus_id``, one
    BM25 index per split), so validation never sees training documents."""
    index = {split.name: BM25Search(split.docs, k=top_k) for split in splits}
    return lambda q: SearchEnv(index[q.corpus_id], q, max_turns, system_prompt)


def scripted_episodes(split: Split, make_env: Callable[[Question], SearchEnv], n: int = 100,
                      min_hops: int = 2, max_hops: int = 4, seed: int = 0,
                      explain: bool = False) -> list[list[Message]]:
    """Chat episodes for a supervised warm start: up to ``n`` questions on a synthetic ``split``'s
    knowledge base that are not among the split's own questions (the warm start must not
    rehearse the questions RL trains on), each played by ``reading_oracle`` in
    ``make_env(question)`` (``explain``: with its reasoning lines). A small knowledge base may have fewer than ``n`` left (the smol
    preset's 1-hop one: 45 of 245 beside 200 training questions)."""
    taken = {q.question for q in split.questions}
    pool = make_questions(split.kb, n + len(taken), min_hops, max_hops, seed=seed,
                          corpus_id=split.name, strict=False)
    questions = [q for q in pool if q.question not in taken][:n]
    if not questions:
        raise ValueError(f"the {split.name} knowledge base has no question left for a warm "
                         f"start beside its {len(taken)} questions: lower --n_train")
    return [run_episode(make_env(q), reading_oracle(q, explain)).messages for q in questions]


def tokenizer_corpus(splits: Sequence[Split], system_prompt: str = SYSTEM_PROMPT) -> list[str]:
    """Every text a model built for the task must tokenise well: all documents, the system
    prompt, all questions (in that order)."""
    return ([doc for split in splits for doc in split.docs] + [system_prompt]
            + [q.question for split in splits for q in split.questions])


@dataclass
class Suite:
    """What train_min's loop needs from a task family (a preset brings its own): make_env(task)
    returns an Environment (reset, step). Tasks are grouped by identity for GRPO and pass@k."""
    train: list                          # training tasks
    val: list                            # validation tasks
    make_env: Callable                   # task -> Environment
    stop_strings: tuple[str, ...] = ()   # a turn ends at one of these (or at end-of-turn / budget)
    corpus: list[str] = field(default_factory=list)   # text for a built model's tokenizer
    warm_start: Callable | None = None   # () -> chat episodes for a built model's warm start
    tokenizer: Callable | None = None    # () -> a built model's tokenizer (default: BPE on corpus)
    decisions: Callable | None = None    # (ids, turn_ids) of a row -> its scored decisions: a task
    #                                      that knows them (the testbed) serves --critic oracle_*


def search_suite(cfg, kb_sizes: dict | None = None, system_prompt: str = SYSTEM_PROMPT,
                 explain: bool = False) -> Suite:
    """The search agent of §10 for train_min's Config `cfg`: synthetic multi-hop questions
    (knowledge base sizes `kb_sizes`, default this file's; with warm-start episodes, `explain`:
    with a reasoning line per turn) or HotpotQA, under `system_prompt`."""
    if cfg.dataset not in ("synthetic", "hotpotqa"):
        raise ValueError(f"--dataset {cfg.dataset} is a preset's task: use --preset {cfg.dataset}")
    train, val = make_splits(cfg.dataset, cfg.n_train, cfg.n_val, cfg.min_hops, cfg.max_hops,
                             cfg.seed, cfg.hotpotqa_path, kb_sizes)
    make_env = env_factory((train, val), cfg.top_k, cfg.max_turns, system_prompt)
    warm_start = None if train.kb is None else lambda: scripted_episodes(
        train, make_env, 100, cfg.min_hops, cfg.max_hops, seed=cfg.seed, explain=explain)
    return Suite(train.questions, val.questions, make_env, ("</search>", "</answer>"),
                 tokenizer_corpus((train, val), system_prompt), warm_start)
