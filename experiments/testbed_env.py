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
N_FILLERS = 4                 # filler words f0..f3: cheap to sample, never scored
TICK = "next"                 # the streaming environment's observation between non-key tokens
VERDICT = ("no", "ok")        # the reply to a key: wrong / right (with feedback on)
MAPPING_SEED = 1234           # f is fixed across tasks, runs and seeds: the thing to learn

# A minimal chat layout: a user message (an observation) opens a block, the assistant's turn
# closes it. No role words: the key is predicted right at the clue, so a tiny random model needs
# no attention circuit to see it and what remains hard is the credit assignment.
#   [user c3, assistant "k1 f0", user c0] -> "<|im_start|>c3 k1 f0<|im_end|><|im_start|>c0 "
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}<|im_end|>"
    "{% else %}<|im_start|>{{ m['content'] }} {% endif %}{% endfor %}"
)


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

    The key of turn k is the first word of the assistant's text after clue c_k is shown (the
    rollout decodes with special tokens removed, so a sampled <|im_start|> or <unk> is invisible);
    a turn that ends early (the model sampled <|im_end|>) keeps whatever words it has; an empty one
    misses its key. Terminal info: correct (0/1 per key), all_correct, turns, malformed (False).
    """

    def __init__(self, task: Task, turn_len: int, streaming: bool = False, feedback: bool = True):
        if turn_len < 1:
            raise ValueError(f"turn_len must be >= 1, got {turn_len}")
        self.task, self.turn_len, self.streaming, self.feedback = task, turn_len, streaming, feedback
        self.correct: list[int] = []
        self.steps, self.done = 0, True

    @property
    def n_steps(self) -> int:
        """Assistant turns in an episode."""
        return len(self.task.clues) * (self.turn_len if self.streaming else 1)

    def reset(self, task: Task | None = None) -> list[dict]:
        self.task = task or self.task
        self.correct, self.steps, self.done = [], 0, False
        return [{"role": "user", "content": clue_word(self.task.clues[0])}]

    def step(self, assistant_text: str) -> StepResult:
        if self.done:
            raise RuntimeError("the episode is over; call reset()")
        first = (assistant_text.split() or [""])[0]
        key_slot = not self.streaming or self.steps % self.turn_len == 0
        if key_slot:
            k = len(self.correct)
            self.correct.append(int(first == key_word(self.task.keys[k])))
        self.steps += 1
        if self.steps == self.n_steps:
            self.done = True
            reward = sum(self.correct) / len(self.correct)
            return StepResult(None, True, reward, {"correct": list(self.correct), "turns": self.steps,
                                                   "all_correct": float(all(self.correct)), "malformed": False})
        reply = [VERDICT[self.correct[-1]]] if key_slot and self.feedback else []
        if not self.streaming or self.steps % self.turn_len == 0:      # the next key turn's clue
            reply.append(clue_word(self.task.clues[len(self.correct)]))
        return StepResult(" ".join(reply) or TICK, False, 0.0, {"turns": self.steps})


def oracle_policy(task: Task, turn_len: int, streaming: bool = False, filler: str = "f0"):
    """A scripted agent that always answers correctly: for tests and the docs' worked example."""
    state = {"n": 0}

    def policy(messages: list[dict]) -> str:
        n, state["n"] = state["n"], state["n"] + 1
        if streaming:
            return key_word(task.keys[n // turn_len]) if n % turn_len == 0 else filler
        return " ".join([key_word(task.keys[n])] + [filler] * (turn_len - 1))
    return policy


# ---------------------------------------------------------------------------------------------
# Word-level tokenizer
# ---------------------------------------------------------------------------------------------

def build_tokenizer(n_keys: int):
    """A word-level PreTrainedTokenizerFast over SPECIALS + words(n_keys), with the chat template.

    Specials are matched before whitespace splitting, so "<|im_start|>c3 k1<|im_end|>" encodes to
    [<|im_start|>, c3, k1, <|im_end|>]; decode (no decoder set) joins words with single spaces. eos =
    <|im_end|> (ends a turn), pad = <|endoftext|>, unk = <unk>; padding on the left for generate.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate([*SPECIALS, *words(n_keys)])}
    wl = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wl.add_special_tokens(list(SPECIALS))
    tok = PreTrainedTokenizerFast(tokenizer_object=wl, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<unk>", extra_special_tokens=["<|im_start|>"], padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    return tok
