"""Shared fixtures and Hypothesis strategies for the mpo.py tests.

A generated batch mimics a multi-turn agent rollout, batch-first [B, T]:

    row = [prompt (0..5)] [turn 0] [obs] [turn 1] [obs] ... [turn n-1] [trailing obs (0..6)]

with 1..40 tokens per turn, 1..6 observation tokens between turns, 0..8 turns per row (the first
row always has at least one turn, so every batch has an action token), and each row padded on the
left or the right to a common T. ``turn_ids`` is k on the tokens of the k-th turn and -1 elsewhere.
Values hold large finite garbage off action positions (mpo.py must never read them); rewards are 0
off action positions, as the contract requires.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# --- Hypothesis profiles --------------------------------------------------------------------------
# "mpo" keeps the whole suite well under two minutes on a 2-core CPU; "mpo-thorough" is for a
# longer local run: HYPOTHESIS_PROFILE=mpo-thorough pytest tests/test_mpo_*.py tests/test_baselines_*.py
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("mpo", max_examples=50, **_common)
settings.register_profile("mpo-thorough", max_examples=300, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "mpo"))

GARBAGE_SCALE = 1e3  # magnitude of the values written at non-action positions
ATOL = 1e-10         # the float64 tolerance of the loop-reference tests


def close(actual, expected, atol: float = ATOL, where=None) -> None:
    """max |actual - expected| <= atol (over `where` if given), compared in float64 (Python numbers
    and lists become float64 directly; torch.as_tensor alone would round them to float32)."""
    a, e = (x.detach().to(torch.float64) if isinstance(x, torch.Tensor)
            else torch.as_tensor(x, dtype=torch.float64) for x in (actual, expected))
    assert a.shape == e.shape, (a.shape, e.shape)
    if where is not None:
        a, e = a[where], e[where]
    err = (a - e).abs().max().item() if a.numel() else 0.0
    assert err <= atol, f"max abs error {err:.3e} > {atol:.0e}"


# --- Layouts --------------------------------------------------------------------------------------
@dataclass
class RowLayout:
    """Segment lengths of one row, in order."""

    prompt: int
    turns: list[int]
    obs: list[int]  # observation run after each turn; the last one is the trailing observation
    pad_left: bool

    @property
    def length(self) -> int:
        return self.prompt + sum(self.turns) + sum(self.obs)


@dataclass
class Layout:
    rows: list[RowLayout]
    extra_pad: int = 0  # padding beyond the longest row

    @property
    def T(self) -> int:
        return max(r.length for r in self.rows) + self.extra_pad


def turn_ids_from_layout(layout: Layout) -> torch.Tensor:
    """[B, T] int64 turn ids for a layout (k on turn k, -1 on prompt/observation/padding)."""
    T = layout.T
    out = []
    for r in layout.rows:
        seq = [-1] * r.prompt
        for k, (n, o) in enumerate(zip(r.turns, r.obs)):
            seq += [k] * n + [-1] * o
        pad = [-1] * (T - len(seq))
        out.append(pad + seq if r.pad_left else seq + pad)
    return torch.tensor(out, dtype=torch.int64)


@st.composite
def row_layouts(draw, min_turns=0, max_turns=8, max_turn_len=40, min_turn_len=1):
    n = draw(st.integers(min_turns, max_turns))
    prompt = draw(st.integers(0, 5))
    pad_left = draw(st.booleans())
    if n == 0:
        return RowLayout(prompt=prompt, turns=[], obs=[], pad_left=pad_left)
    turns = draw(st.lists(st.integers(min_turn_len, max_turn_len), min_size=n, max_size=n))
    between = draw(st.lists(st.integers(1, 6), min_size=n - 1, max_size=n - 1))
    trailing = draw(st.integers(0, 6))
    return RowLayout(prompt=prompt, turns=turns, obs=between + [trailing], pad_left=pad_left)


@st.composite
def layouts(draw, min_rows=1, max_rows=4, max_turns=8, max_turn_len=40, min_turn_len=1,
            allow_empty_rows=True, min_turns=1):
    """A ragged batch layout. Row 0 has at least ``min_turns`` (>= 1) turns; other rows may have
    none when ``allow_empty_rows``."""
    B = draw(st.integers(min_rows, max_rows))
    rows = [draw(row_layouts(min_turns=max(min_turns, 1), max_turns=max_turns,
                             max_turn_len=max_turn_len, min_turn_len=min_turn_len))]
    lo = 0 if allow_empty_rows else max(min_turns, 1)
    for _ in range(B - 1):
        rows.append(draw(row_layouts(min_turns=lo, max_turns=max_turns,
                                     max_turn_len=max_turn_len, min_turn_len=min_turn_len)))
    rows = draw(st.permutations(rows))
    return Layout(rows=list(rows), extra_pad=draw(st.integers(0, 3)))


# --- Batches --------------------------------------------------------------------------------------
@dataclass
class Batch:
    layout: Layout
    turn_ids: torch.Tensor  # (B, T) int64
    values: torch.Tensor  # (B, T) float64; garbage off action positions
    rewards: torch.Tensor  # (B, T) float64; 0 off action positions
    scores: torch.Tensor  # (B,) float64
    logp: torch.Tensor  # (B, T) float64; log-probs of the current policy
    old_logp: torch.Tensor  # (B, T) float64
    seed: int
    extra: dict = field(default_factory=dict)

    @property
    def mask(self) -> torch.Tensor:
        return self.turn_ids >= 0


def make_batch(layout: Layout, seed: int, reward_kind: str = "dense", dtype=torch.float64,
               log_ratio_scale: float = 0.05) -> Batch:
    """Random values/rewards/log-probs for a layout (deterministic in ``seed``).

    reward_kind: "dense" (a reward on every action token), "sparse" (on ~20% of action tokens),
    "outcome" (the row's score on its last action token, 0 elsewhere).
    """
    g = torch.Generator().manual_seed(seed)
    turn_ids = turn_ids_from_layout(layout)
    mask = turn_ids >= 0
    B, T = turn_ids.shape
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    garbage = GARBAGE_SCALE * torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.where(mask, values, garbage)
    scores = torch.randint(0, 2, (B,), generator=g).to(torch.float64)
    if reward_kind == "dense":
        rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    elif reward_kind == "sparse":
        rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
        rewards = rewards * (torch.rand(B, T, generator=g) < 0.2)
    elif reward_kind == "outcome":
        rewards = torch.zeros(B, T, dtype=torch.float64)
        for b in range(B):
            pos = mask[b].nonzero().flatten()
            if len(pos):
                rewards[b, pos[-1]] = scores[b]
    else:
        raise ValueError(reward_kind)
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    old_logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3.0
    logp = old_logp + log_ratio_scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    garbage_lp = GARBAGE_SCALE * torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = torch.where(mask, logp, garbage_lp)
    return Batch(layout, turn_ids, values.to(dtype), rewards.to(dtype), scores.to(dtype),
                 logp.to(dtype), old_logp.to(dtype), seed)


@st.composite
def batches(draw, reward_kinds=("dense", "sparse", "outcome"), log_ratio_scale=0.05, **layout_kw):
    layout = draw(layouts(**layout_kw))
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(reward_kinds))
    return make_batch(layout, seed, reward_kind=kind, log_ratio_scale=log_ratio_scale)


# Coefficients: endpoints included, since λ = 0 / 1 are the cases vectorised code gets wrong.
lams = st.one_of(st.sampled_from([0.0, 1.0, 0.8, 0.95]), st.floats(0.0, 1.0))
betas = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 3.0))


# --- Helpers --------------------------------------------------------------------------------------
def insert_minus_one_positions(turn_ids: torch.Tensor, tensors: dict[str, torch.Tensor], seed: int,
                               max_insert: int = 4, fill: dict[str, str] | None = None):
    """Insert runs of -1 positions (prompt / observation / padding) at random places of every row
    that do not split a turn. Returns (new_turn_ids, new_tensors, action_index) where
    action_index[b] lists, in order, the new column of each original action token of row b.

    fill[name] = "zero" puts 0 at inserted positions, otherwise large random garbage.
    """
    fill = fill or {}
    g = torch.Generator().manual_seed(seed)
    B, T = turn_ids.shape
    new_rows, new_vals, idx = [], {k: [] for k in tensors}, []
    for b in range(B):
        tid = turn_ids[b].tolist()
        seq, cols, vals = [], [], {k: [] for k in tensors}
        for p in range(T + 1):
            # a cut before position p is allowed unless p-1 and p lie in the same turn
            splits = 0 < p < T and tid[p - 1] >= 0 and tid[p - 1] == tid[p]
            if not splits:
                n = int(torch.randint(0, max_insert + 1, (1,), generator=g))
                seq += [-1] * n
                for k, t in tensors.items():
                    if fill.get(k) == "zero":
                        vals[k] += [0.0] * n
                    else:
                        vals[k] += (GARBAGE_SCALE * torch.randn(n, generator=g,
                                                                dtype=torch.float64)).tolist()
            if p < T:
                if tid[p] >= 0:
                    cols.append(len(seq))
                seq.append(tid[p])
                for k, t in tensors.items():
                    vals[k].append(float(t[b, p]))
        new_rows.append(seq)
        idx.append(cols)
        for k in tensors:
            new_vals[k].append(vals[k])
    T2 = max(len(s) for s in new_rows)
    out_tid = torch.full((B, T2), -1, dtype=torch.int64)
    out = {k: torch.zeros(B, T2, dtype=tensors[k].dtype) for k in tensors}
    for b in range(B):
        n = len(new_rows[b])
        out_tid[b, :n] = torch.tensor(new_rows[b])
        for k in tensors:
            out[k][b, :n] = torch.tensor(new_vals[k][b], dtype=tensors[k].dtype)
            # trailing padding: zero for "zero" tensors, else garbage
            if fill.get(k) != "zero" and n < T2:
                out[k][b, n:] = GARBAGE_SCALE * torch.randn(T2 - n, generator=g, dtype=torch.float64)
    return out_tid, out, idx


def gather_actions(x: torch.Tensor, action_index) -> list[list[float]]:
    return [[float(x[b, c]) for c in cols] for b, cols in enumerate(action_index)]


@pytest.fixture
def worked_example():
    """§5 of the paper notes: one trajectory, 3 turns of 8, 10, 22 tokens separated by observations,
    V = 0.3 / 0.5 / 0.7 constant within turns 0 / 1 / 2, R(τ) = 1 on the last token."""
    layout = Layout(rows=[RowLayout(prompt=4, turns=[8, 10, 22], obs=[3, 5, 0], pad_left=False)],
                    extra_pad=2)
    turn_ids = turn_ids_from_layout(layout)
    values = torch.full(turn_ids.shape, 123.0, dtype=torch.float64)  # garbage off action
    for k, v in enumerate([0.3, 0.5, 0.7]):
        values[turn_ids == k] = v
    rewards = torch.zeros(turn_ids.shape, dtype=torch.float64)
    last = (turn_ids[0] >= 0).nonzero().flatten()[-1]
    rewards[0, last] = 1.0
    return turn_ids, values, rewards


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module of tiny-model tests: on a loaded 2-core machine, two OpenMP
    threads make each tiny matmul orders of magnitude slower (measured here: 24 ms vs 0.02 ms)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --- The tiny model of the tests that train (test_train_*, test_trainer_gpu_path, test_turn_critic,
#     test_grid, test_critic_offline)
@pytest.fixture(scope="module")
def base(tmp_path_factory, request):
    """A folder per test module for its runs and its tiny model."""
    return tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_"))


@pytest.fixture(scope="module")
def tiny_path(base) -> str:
    """The tiny model, built once per module, where `main` looks for it for out_dirs inside
    `base` (helpers.make_cfg builds a Config on it)."""
    import presets
    import train_min
    cfg = train_min.parse_config(["--preset", "tiny", "--out_dir", str(base / "unused")])
    return presets.build_tiny_model(base / ".tiny-qwen2", train_min.make_suite(cfg).corpus)


# --- The trainer tests' shared model (test_train_update, test_train_rollout), one per module ------
@pytest.fixture(scope="module")
def cfg(tiny_path, base):
    """A --preset tiny Config on the module's tiny model (helpers.make_cfg)."""
    from helpers import make_cfg
    return make_cfg(tiny_path, base)


@pytest.fixture(scope="module")
def suite(cfg):
    import train_min
    return train_min.make_suite(cfg)


@pytest.fixture(scope="module")
def loaded(cfg):
    """Tokenizer, PEFT model and value head; LoRA B and the value head are randomised (they start
    at zero), so the two adapters compute different functions and values are not all 0."""
    import train_min
    from helpers import randomise_lora_b, trainable
    tok, model, value_head = train_min.load_model(cfg, torch.device("cpu"))
    randomise_lora_b(model, 0.05, seed=1234, value_head=value_head, value_head_std=0.3)
    snapshot = {n: p.detach().clone() for n, p in trainable(model, value_head).items()}
    return tok, model, value_head, snapshot


@pytest.fixture
def fresh(loaded):
    """The shared model with its trainable weights reset and no gradients: order-independent tests."""
    import itertools
    import train_min
    from helpers import trainable
    tok, model, value_head, snapshot = loaded
    params = trainable(model, value_head)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(snapshot[n])
    for p in itertools.chain(model.parameters(), value_head.parameters()):
        p.grad = None
    train_min.use_adapter(model, "policy")
    return tok, model, value_head
