"""A credit-assignment testbed that a tiny random transformer learns from scratch on a CPU.

Each episode has K turns. Before turn k the environment shows one clue word c_k; the assistant
then writes a turn of L words. Only the turn's first word decides anything: it must be the key
f(c_k) of a fixed hidden mapping f (the same for every task, so it can be learned). The other
L − 1 words are filler and change nothing. The outcome reward comes once, at the end:

    R(τ) = (1/K) Σ_k 1{first word of turn k = f(c_k)}                  (fraction of keys right)

so the policy must find, from one number per episode, which of its K·L tokens mattered: the
credit-assignment problem of the paper (§2: a key tool call among filler tokens) in miniature.
Between turns the environment answers as a tool would: its reply says whether the last key was
right ("ok" / "no") and shows the next clue. The reply is an observation, not a reward: a critic
can learn to read it (progress becomes visible at turn boundaries, as search results show
whether a query worked), the policy's reward is still only R(τ) at the end.

    episode (K = 2, L = 3)     user: c5 | assistant: k2 f1 f3 | user: ok c0 | assistant: k7 f0 c1
                               reward = (1{k2 = f(c5)} + 1{k7 = f(c0)}) / 2 = 1/2 if k7 is wrong

Knobs (train_min.py flags): `--testbed_turns` K, `--testbed_turn_len` L, `--testbed_keys` (the
number of clue/key pairs), `--testbed_feedback false` (the reply shows only the next clue), and
`--testbed_streaming`: the counterexample of §11, where the environment interjects after *every*
token. Each assistant turn is then one token (K·L turns); the reply after a key token is its
verdict, after the last filler of a group the next clue, after other fillers "next"; the task and
the reward are unchanged. Every turn is one token, so turn-level and token-level credit coincide
there: MPO's turn GAE becomes token GAE with λ = 0.8, its turn ratio the token ratio, and its
centred correction is zero.

The regime of the paper's argument (§2: credit crossing long turns; docs/testbed.md, "v2"):

- `--testbed_decisive first`: only turn 0's key decides, R = 1{key of turn 0 = f(c_0)} (0 or 1),
  still paid at the end of the last turn; turns 1..K−1 show "next" instead of a clue and their
  words change nothing, so R's credit must cross K − 1 turns to reach the decision.
- `--testbed_key_anywhere`: a turn's answer is its first key word wherever it stands (words
  before it are fillers), so the decisive token has no fixed position in its turn.
- `--testbed_verdict_delay d` (v3, with decisive first and no feedback): the observation before
  turn d says "ok" or "no" for turn 0's key, the others "next": the outcome becomes visible at a
  turn boundary (d = 1: the next one; d = 2: one turn later), as a search result shows whether a
  query worked. The reward is unchanged.
- `--testbed_key_last`: a turn's answer is its *last* key word (the mirror of key anywhere: the
  decisive token sits late in its turn; docs/records/testbed/v4-beta-probe.md).
- `--testbed_two_keys` (issue 62): two decisions per turn. Each turn shows two clues; the turn's
  first two key words answer them in order (a missing key is wrong), R = the fraction of the 2K
  answers right, and the reply after the turn gives both verdicts.
- `--testbed_full_turns`: every turn runs to its L tokens. train_min's `generate` stops a turn at
  the tokenizer's eos / pad / `<|im_end|>`; this tokenizer closes turns with `<|end|>` and pads with
  `<unk>`, so no sampleable id stops a turn (a sampled `<|end|>` is an ordinary word, decoded
  away). Without it a random policy ends its turns after ~10 tokens whatever L is (measured at
  L = 64: 9-11 sampled tokens per turn), and L would be only a cap.

Vocabulary: the words below plus the chat markers; the tokenizer (`build_tokenizer`) is
word-level, one id per word, and the chat template renders only vocabulary words, so every
sampled id decodes and re-encodes to itself. Run through train_min.py (`--preset testbed`),
which builds a tiny Qwen2 with this tokenizer (no warm start) and trains it with the ordinary
rollout → advantages → update loop; see docs/testbed.md.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from search_env import StepResult

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
# --testbed_full_turns: the same four ids, the end-of-turn marker renamed so that train_min's
# generate does not stop at it (it stops at eos, pad and "<|im_end|>"); pad is <unk>, eos none
FULL_TURN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|end|>", "<unk>")
N_FILLERS = 4                 # filler words f0..f3: cheap to sample, never scored
TICK = "next"                 # the streaming environment's observation between non-key tokens
VERDICT = ("no", "ok")        # the reply to a key: wrong / right (with feedback on)
MAPPING_SEED = 1234           # f is fixed across tasks, runs and seeds: the thing to learn
DECISIVE = ("every", "first")  # --testbed_decisive: every turn's key counts, or turn 0's only

# A minimal chat layout: a user message (an observation) opens a block, the assistant's turn
# closes it. No role words: the key is predicted right at the clue, so a tiny random model needs
# no attention circuit to see it and what remains hard is the credit assignment.
#   [user c3, assistant "k1 f0", user c0] -> "<|im_start|>c3 k1 f0<|im_end|><|im_start|>c0 "
def chat_template(end: str = "<|im_end|>") -> str:
    """The layout above with `end` closing an assistant turn ("<|end|>" with full turns)."""
    return ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}" + end
            + "{% else %}<|im_start|>{{ m['content'] }} {% endif %}{% endfor %}")


CHAT_TEMPLATE = chat_template()


def clue_word(i: int) -> str:
    return f"c{i}"


def key_word(i: int) -> str:
    return f"k{i}"


def words(n_keys: int) -> list[str]:
    """The vocabulary's words (specials excluded): clues, keys, fillers, the tick, the verdicts.

    Example: words(2) -> ['c0', 'c1', 'k0', 'k1', 'f0', 'f1', 'f2', 'f3', 'next', 'no', 'ok'].
    """
    return [*map(clue_word, range(n_keys)), *map(key_word, range(n_keys)),
            *(f"f{i}" for i in range(N_FILLERS)), TICK, *VERDICT]


def is_key(word: str) -> bool:
    """A key word k<i>. Example: is_key("k3") -> True; is_key("f3"), is_key("ok") -> False."""
    return word[:1] == "k" and word[1:].isdigit()


def check_options(streaming: bool = False, decisive: str = "every", key_anywhere: bool = False,
                  full_turns: bool = False, verdict_delay: int = 0, turns: int | None = None,
                  feedback: bool = False, key_last: bool = False, two_keys: bool = False) -> None:
    """Refuse the testbed flag combinations that mean nothing (a ValueError naming the flags)."""
    if two_keys and (streaming or key_last or decisive != "every"):
        raise ValueError("--testbed_two_keys (a turn's first two key words answer its two clues, "
                         "wherever they stand) needs --testbed_decisive every and excludes "
                         "--testbed_streaming and --testbed_key_last")
    if key_last and (key_anywhere or streaming):
        raise ValueError("--testbed_key_last (a turn's answer is its last key word) excludes "
                         "--testbed_key_anywhere (its first) and --testbed_streaming (one-token "
                         "turns); choose one")
    if verdict_delay:
        if verdict_delay < 0 or decisive != "first":
            raise ValueError(f"--testbed_verdict_delay {verdict_delay}: a delayed verdict shows "
                             "turn 0's decisive key; it needs --testbed_decisive first and d >= 0")
        if turns is not None and verdict_delay >= turns:
            raise ValueError(f"--testbed_verdict_delay {verdict_delay} must be below "
                             f"--testbed_turns {turns}: the verdict is shown before turn d")
        if streaming or feedback:
            raise ValueError("--testbed_verdict_delay needs --testbed_feedback false and no "
                             "--testbed_streaming: it replaces the immediate verdict")
    if decisive not in DECISIVE:
        raise ValueError(f"--testbed_decisive must be one of {', '.join(DECISIVE)}, got {decisive!r}")
    if streaming and key_anywhere:
        raise ValueError("--testbed_key_anywhere needs turns of several tokens: with "
                         "--testbed_streaming every turn is one token and the key's slot is fixed")
    if streaming and full_turns:
        raise ValueError("--testbed_full_turns does nothing with --testbed_streaming: every turn "
                         "is already its one token")


def hidden_mapping(n_keys: int) -> list[int]:
    """f as a list: clue c_i has key k_{f[i]}. A fixed random permutation (seed MAPPING_SEED)."""
    perm = list(range(n_keys))
    random.Random(MAPPING_SEED).shuffle(perm)
    return perm


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    clues: tuple[int, ...]     # c_0 .. c_{K-1}, indices into the clue words
    keys: tuple[int, ...]      # f(c_0) .. f(c_{K-1}), the answers


def make_tasks(n_train: int, n_val: int, turns: int, n_keys: int, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Random clue sequences, disjoint between train and val when the space allows (n_keys^turns).

    The mapping f is shared, so validation measures the learned mapping on unseen sequences.
    """
    if turns < 1 or n_keys < 2:
        raise ValueError(f"testbed needs turns >= 1 and n_keys >= 2, got {turns}, {n_keys}")
    f = hidden_mapping(n_keys)
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    tasks = []
    distinct = n_keys ** turns >= n_train + n_val
    while len(tasks) < n_train + n_val:
        clues = tuple(rng.randrange(n_keys) for _ in range(turns))
        if distinct and clues in seen:
            continue
        seen.add(clues)
        tasks.append(Task(clues, tuple(f[c] for c in clues)))
    return tasks[:n_train], tasks[n_train:]


def turn_budget(turns: int, turn_len: int, streaming: bool) -> tuple[int, int]:
    """(max_turns, max_new_tokens) of train_min's rollout: K turns of L tokens, or K·L of 1."""
    return (turns * turn_len, 1) if streaming else (turns, turn_len)


def max_episode_tokens(turns: int, turn_len: int, streaming: bool) -> int:
    """An upper bound on an episode's length in tokens (prompt, turns, observations)."""
    obs = 4                    # <|im_end|> <|im_start|> [VERDICT] [CLUE | TICK]
    n_turns, n_new = turn_budget(turns, turn_len, streaming)
    return 2 + n_turns * (n_new + obs)


# ---------------------------------------------------------------------------------------------
# Environment (search_env.Environment interface: reset() -> messages, step(text) -> StepResult)
# ---------------------------------------------------------------------------------------------

class KeyTurnEnv:
    """One episode of `task`: K turns of `turn_len` words, or K·L one-word turns when `streaming`.

    A turn's answer is its first word, with `key_anywhere` its first key word, with `key_last`
    its last key word (the rollout
    decodes with special tokens removed, so a sampled <|im_start|> or <unk> is invisible); a turn
    that ends early (the model sampled <|im_end|>) keeps whatever words it has; a turn without an
    answer misses its key. `decisive`: "every" (each turn's key counts, R = fraction right) or
    "first" (only turn 0's, R = 0/1; later turns see "next" and are not scored). `verdict_delay`
    d > 0 (with "first", no feedback): the observation before turn d says whether turn 0's key was
    right (ok / no), the others "next": progress shows at the d-th turn boundary; R is the same.
    Terminal info: correct (0/1 per scored key), all_correct, turns, malformed (False).

    Example (K = 3, L = 3, first, key anywhere, d = 2; turn 0 right):
        observations c5 | next | ok, reward 1.0 (d = 1: c5 | ok | next; d = 0: c5 | next | next)
    """

    def __init__(self, task: Task, turn_len: int, streaming: bool = False, feedback: bool = True,
                 decisive: str = "every", key_anywhere: bool = False, verdict_delay: int = 0,
                 key_last: bool = False, two_keys: bool = False):
        if turn_len < 1:
            raise ValueError(f"turn_len must be >= 1, got {turn_len}")
        check_options(streaming, decisive, key_anywhere, verdict_delay=verdict_delay,
                      turns=len(task.clues), feedback=feedback, key_last=key_last,
                      two_keys=two_keys)
        if two_keys and len(task.clues) % 2:
            raise ValueError(f"--testbed_two_keys needs two clues per turn, got {len(task.clues)}")
        self.task, self.turn_len, self.streaming, self.feedback = task, turn_len, streaming, feedback
        self.decisive, self.key_anywhere, self.key_last = decisive, key_anywhere, key_last
        self.per_turn = 2 if two_keys else 1          # decisions (clues) per turn
        self.verdict_delay = verdict_delay      # d > 0: turn 0's verdict shown before turn d
        self.correct: list[int] = []
        self.steps, self.done = 0, True

    @property
    def n_steps(self) -> int:
        """Assistant turns in an episode."""
        return len(self.task.clues) // self.per_turn * (self.turn_len if self.streaming else 1)

    def reset(self, task: Task | None = None) -> list[dict]:
        self.task = task or self.task
        self.correct, self.steps, self.done = [], 0, False
        return [{"role": "user", "content": " ".join(map(clue_word,
                                                         self.task.clues[:self.per_turn]))}]

    def answer(self, assistant_text: str) -> str:
        """The turn's answer: its first word, its first key word with key_anywhere, its last key
        word with key_last ("": none); with two keys per turn, see `answers`."""
        words = assistant_text.split()
        if self.key_anywhere or self.key_last:
            words = [w for w in words if is_key(w)]
        return (words or [""])[-1 if self.key_last else 0]

    def answers(self, assistant_text: str) -> list[str]:
        """The turn's answers, one per clue: with two keys its first two key words in order ("":
        missing), else [answer]."""
        if self.per_turn == 1:
            return [self.answer(assistant_text)]
        keys = [w for w in assistant_text.split() if is_key(w)]
        return (keys + [""] * self.per_turn)[:self.per_turn]

    def step(self, assistant_text: str) -> StepResult:
        if self.done:
            raise RuntimeError("the episode is over; call reset()")
        group = self.steps // self.turn_len if self.streaming else self.steps   # logical turn k
        key_slot = not self.streaming or self.steps % self.turn_len == 0
        scored = key_slot and (self.decisive == "every" or group == 0)
        if scored:
            for j, word in enumerate(self.answers(assistant_text)):
                right = word == key_word(self.task.keys[group * self.per_turn + j])
                self.correct.append(int(right))
        self.steps += 1
        if self.steps == self.n_steps:
            self.done = True
            reward = sum(self.correct) / len(self.correct)
            return StepResult(None, True, reward, {"correct": list(self.correct), "turns": self.steps,
                                                   "all_correct": float(all(self.correct)), "malformed": False})
        reply = ([VERDICT[c] for c in self.correct[-self.per_turn:]] if scored and self.feedback
                 else [])
        if self.verdict_delay and self.steps == self.verdict_delay:   # before turn d: turn 0's
            reply = [VERDICT[self.correct[0]]]
        group_ends = not self.streaming or self.steps % self.turn_len == 0
        if group_ends and self.decisive == "every":                     # the next key turn's clues
            k = self.steps // self.turn_len if self.streaming else self.steps
            reply += map(clue_word, self.task.clues[k * self.per_turn:(k + 1) * self.per_turn])
        return StepResult(" ".join(reply) or TICK, False, 0.0, {"turns": self.steps})


# ---------------------------------------------------------------------------------------------
# The decisions a rollout row holds (issue 62): what an oracle critic reads
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Decision:
    """One scored answer of a row: its turn, where it was decided, its clue and its verdict."""
    turn: int                  # k: the assistant turn that answers it
    at: int | None             # the row position of its deciding key word (None: the turn had none)
    end: int                   # the row position of the turn's last token
    clue: int                  # the clue it answers
    right: int                 # 1: the answer was the clue's key


def vocabulary(n_keys: int, full_turns: bool = False) -> list[str]:
    """`build_tokenizer`'s words by id: the four specials, then words(n_keys)."""
    return [*(FULL_TURN_SPECIALS if full_turns else SPECIALS), *words(n_keys)]


class DecisionReader:
    """A row's decisions read from its token ids alone, by the environment's own rules (the
    answer of a turn is what `KeyTurnEnv.answers` takes from the decoded turn: specials removed,
    then its first word, first / last key word, or first two key words); the clues a turn answers
    are those of the observation before it. Σ right / n_decisions is the row's reward.
    Called with one row: `reader(ids, turn_ids)` -> list[Decision], in the row's order."""

    def __init__(self, n_keys: int, full_turns: bool = False, decisive: str = "every",
                 key_anywhere: bool = False, key_last: bool = False, two_keys: bool = False,
                 turns: int = 1, streaming: bool = False):
        if streaming:
            raise ValueError("an oracle critic reads turns of several tokens: --testbed_streaming "
                             "has one-token turns (use --critic token)")
        self.vocab, self.f = vocabulary(n_keys, full_turns), hidden_mapping(n_keys)
        self.special = set(self.vocab[:len(SPECIALS)])
        self.rule = "two" if two_keys else "last" if key_last else \
            "anywhere" if key_anywhere else "first"
        self.decisive, self.n_clues = decisive, n_keys
        self.per_turn = 2 if two_keys else 1
        self.n_decisions = self.per_turn * (turns if decisive == "every" else 1)

    def __call__(self, ids: list[int], turn_ids: list[int]) -> list[Decision]:
        turns, seen, shown, current = {}, [], [], -1      # turn -> (its clues, its positions)
        for p, (i, t) in enumerate(zip(ids, turn_ids)):
            word = self.vocab[i] if 0 <= i < len(self.vocab) else ""
            if t < 0:                                      # an observation (or prompt, padding)
                if word[:1] == "c" and word[1:].isdigit():
                    seen.append(int(word[1:]))
            else:
                if t != current:                           # a turn starts: its clues were shown
                    shown, seen, current = (seen or shown), [], t
                    turns[t] = (shown, [])
                turns[t][1].append(p)
        out = []
        for k, (clues, positions) in sorted(turns.items()):
            if self.decisive != "every" and k > 0:
                break
            said = [(p, self.vocab[ids[p]] if ids[p] < len(self.vocab) else "") for p in positions]
            said = [(p, w) for p, w in said if w not in self.special]
            keys = [(p, w) for p, w in said if is_key(w)]
            picked = {"first": said[:1], "anywhere": keys[:1], "last": keys[-1:],
                      "two": keys[:2]}[self.rule]
            for j in range(self.per_turn):
                clue = clues[j]
                at, word = picked[j] if j < len(picked) else (None, "")
                out.append(Decision(k, at, positions[-1], clue,
                                    int(word == key_word(self.f[clue]))))
        return out


def oracle_policy(task: Task, turn_len: int, streaming: bool = False, filler: str = "f0",
                  key_at: int = 0):
    """A scripted agent that always answers correctly, its key at word `key_at` of each turn
    (fillers around it): for tests and the docs' worked example."""
    state = {"n": 0}

    def policy(messages: list[dict]) -> str:
        n, state["n"] = state["n"], state["n"] + 1
        if streaming:
            return key_word(task.keys[n // turn_len]) if n % turn_len == 0 else filler
        turn = [filler] * turn_len
        turn[key_at] = key_word(task.keys[n])
        return " ".join(turn)
    return policy


# ---------------------------------------------------------------------------------------------
# Word-level tokenizer
# ---------------------------------------------------------------------------------------------

def corpus(n_keys: int, full_turns: bool = False) -> list[str]:
    """The tiny model's build text (part of its cache key): the words, and with full turns the
    renamed end marker, so the two tokenizers never share a cached model folder."""
    return [" ".join(words(n_keys))] + ([FULL_TURN_SPECIALS[2]] if full_turns else [])


def build_tokenizer(n_keys: int, full_turns: bool = False):
    """A word-level PreTrainedTokenizerFast over SPECIALS + words(n_keys), with the chat template.

    Specials are matched before whitespace splitting, so "<|im_start|>c3 k1<|im_end|>" encodes to
    [<|im_start|>, c3, k1, <|im_end|>]; decode (no decoder set) joins words with single spaces. eos =
    <|im_end|> (ends a turn), pad = <|endoftext|>, unk = <unk>; padding on the left for generate.
    full_turns: FULL_TURN_SPECIALS (the same ids), turns closed by <|end|>, no eos, pad = <unk>:
    nothing the policy can sample stops `generate`, so every turn has max_new_tokens ids.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = FULL_TURN_SPECIALS if full_turns else SPECIALS
    vocab = {w: i for i, w in enumerate([*specials, *words(n_keys)])}
    wl = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wl.add_special_tokens(list(specials))
    if full_turns:                  # no eos; the unused <|endoftext|> and <|end|> decode away
        ends = {"eos_token": None, "pad_token": "<unk>", "extra_special_tokens": list(specials[:3])}
    else:
        ends = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                "extra_special_tokens": ["<|im_start|>"]}
    tok = PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="<unk>", padding_side="left",
                                  **ends)
    tok.chat_template = chat_template(specials[2])
    return tok
