"""Issue 62, item 1: β's expected update, checked by exact enumeration (docs/beta.md).

At θ = old, before whitening, with K turns of L tokens: token (t, i)'s expected update under
Eq. (20), E_old[∂ log π(y_{t,i}) · A^MAE_{t,i}], is its true gradient ∂J/∂θ_{t,i} times
  perfect critic  (V = E_old[R | prefix]):         1 + β(1 − w_i), w_i = (1/L) Σ_{j≤i} λ_intra^{i−j}
  boundary critic (V = E_old[R | turns before]):    1 + β(λ_intra^{L−i} − mean_j λ_intra^{L−j}).
Every action sequence is enumerated with its probability (a categorical policy with its own logits
per position), advantages come from `mpo.mpo_advantages`, the update from `mpo.turn_ratio` and
autograd, the true gradient from ∇ Σ_y π_θ(y) R(y)."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import mpo

LAM = 0.8                     # turn λ: drops out of every factor (asserted through the grid)
BETAS = (0.0, 0.5, 1.0)
REWARDS = ("one", "indep", "and", "xor", "table")


def closed_form(L: int, beta: float, lam_intra: float, critic: str) -> torch.Tensor:
    """(L,) the factor per position i = 1..L of a turn."""
    i = torch.arange(1, L + 1, dtype=torch.float64)
    if critic == "perfect":
        w = torch.stack([(lam_intra ** (k - i[:int(k)])).sum() for k in i]) / L  # (L,)
        return 1 + beta * (1 - w)
    end = lam_intra ** (L - i)
    return 1 + beta * (end - end.mean())


class Turns:
    """Every action sequence of K turns of L tokens, an observation token before each turn.
    n_act[p] actions at action position p (1: a fixed token, still a turn position)."""

    def __init__(self, K: int, L: int, n_act: list[int], seed: int, probs=None):
        self.K, self.L, self.n = K, L, K * L
        ys = torch.tensor(list(itertools.product(*[range(a) for a in n_act])))  # (N, n)
        self.ys, self.N, A = ys, ys.shape[0], max(n_act)
        g = torch.Generator().manual_seed(seed)
        logit0 = (torch.randn(self.n, A, generator=g, dtype=torch.float64) if probs is None
                  else torch.tensor(probs, dtype=torch.float64).log())      # (n, A) π_old's logits
        self.bad = torch.arange(A)[None, :] >= torch.tensor(n_act)[:, None]  # (n, A) no such action
        self.theta = torch.zeros(self.n, A, dtype=torch.float64, requires_grad=True)
        logits = (logit0 + self.theta).masked_fill(self.bad, -math.inf)
        self.logp = F.log_softmax(logits, -1).gather(1, ys.T).T              # (N, n) log π_θ(y_p)
        self.old = self.logp.detach()
        self.w = self.old.sum(1).exp()                                        # (N,) π_old(y)
        suffix = torch.tensor(n_act[::-1]).cumprod(0).flip(0)                 # (n,) rows per prefix
        self.prefix = torch.arange(self.N)[:, None] // suffix                 # (N, n) y_<p's group
        tid = [[-1] + [t] * L for t in range(K)]                              # observation, turn t
        self.tid = torch.tensor(sum(tid, []) + [-1]).expand(self.N, -1)       # (N, T)
        self.act = self.tid[0] >= 0                                           # (T,)

    def cond_mean(self, x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        """E_old[x | group] on every row."""
        k = int(group.max()) + 1
        num = torch.zeros(k, dtype=x.dtype).index_add(0, group, self.w * x)
        return (num / torch.zeros(k, dtype=x.dtype).index_add(0, group, self.w))[group]

    def values(self, R: torch.Tensor, critic: str) -> torch.Tensor:
        """(N, T) V before each action token: E[R | prefix] or E[R | the turns before]; 0 off."""
        p = torch.arange(self.n)
        if critic == "boundary":
            p = p // self.L * self.L                                          # the turn's start
        V = torch.stack([self.cond_mean(R, self.prefix[:, q]) for q in p.tolist()], 1)  # (N, n)
        out = torch.zeros(self.N, self.tid.shape[1], dtype=torch.float64)
        out[:, self.act] = V
        return out

    def advantages(self, R, critic, beta, lam_intra, whiten=False):
        adv, _ = mpo.mpo_advantages(mpo.outcome_rewards(R, self.tid), self.values(R, critic),
                                    self.tid, lam=LAM, lam_intra=lam_intra, beta=beta,
                                    whiten=whiten)
        return adv                                                            # (N, T)

    def update(self, adv: torch.Tensor, weight: torch.Tensor, rows=slice(None)) -> torch.Tensor:
        """(n, A) Σ_rows weight · Σ_p ρ̃_p A_p's gradient at θ = old (the stop-gradient turn
        ratio's); adv (len(rows), T) on the rows (default: every sequence once)."""
        logp = torch.zeros(adv.shape, dtype=torch.float64)
        old = torch.zeros_like(logp)
        logp[:, self.act], old[:, self.act] = self.logp[rows], self.old[rows]
        rho = mpo.turn_ratio(logp, old, self.tid[0].expand(adv.shape[0], -1))
        (g,) = torch.autograd.grad((weight * (rho * adv).sum(1)).sum(), self.theta,
                                   retain_graph=True)
        return g

    def true_gradient(self, R: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad((self.logp.sum(1).exp() * R).sum(), self.theta,
                                   retain_graph=True)
        return g                                                              # (n, A) ∇J


def reward(kind: str, ys: torch.Tensor, keys: list[list[int]], seed: int) -> torch.Tensor:
    """(N,) R from each turn's decisive tokens (keys[t]: their action positions); action 0 right.
    "table": a random table over every position (R couples all tokens and turns)."""
    right = (ys == 0).double()
    if kind == "table":
        code = (ys * ys.max().add(1) ** torch.arange(ys.shape[1])).sum(1)
        return torch.rand(int(code.max()) + 1, generator=torch.Generator().manual_seed(seed),
                          dtype=torch.float64)[code]
    per_turn = []
    for k in keys:
        a, b = right[:, k[0]], right[:, k[-1]]
        per_turn.append({"one": a, "indep": (a + b) / 2, "and": a * b,
                         "xor": (ys[:, k[0]] != ys[:, k[-1]]).double()}[kind])
    return torch.stack(per_turn, 1).mean(1)


def setup(K: int, L: int, kind: str, seed: int, max_rows: int = 2048):
    """Turns with random decisive positions per turn (3 actions for "one", 2 otherwise) and as
    many 2-action free tokens as fit in max_rows; the rest are fixed tokens."""
    g = torch.Generator().manual_seed(seed)
    n_keys = 1 if kind == "one" else 2
    keys = [sorted((t * L + torch.randperm(L, generator=g)[:n_keys]).tolist()) for t in range(K)]
    if kind == "table":
        keys = [[p] for p in range(K * L)]
    n_act = [1] * (K * L)
    for p in sum(keys, []):
        n_act[p] = 3 if kind == "one" else 2
    free = [p for p in torch.randperm(K * L, generator=g).tolist() if n_act[p] == 1]
    for p in free:
        if math.prod(n_act) * 2 <= max_rows:
            n_act[p] = 2
    if kind == "table":                              # every position decisive: keep it small
        n_act = [2] * (K * L)
    turns = Turns(K, L, n_act, seed)
    return turns, reward(kind, turns.ys, keys, seed), keys


GRID = [(K, L, kind) for K in (1, 2, 3) for L in range(2, 7) for kind in REWARDS
        if kind != "table" or K * L <= 10]


@pytest.mark.parametrize("K,L,kind", GRID)
def test_factors_by_exact_enumeration(K, L, kind):
    """Both closed forms hold to 1e-9 on every decisive token of every turn, for every β, λ_intra
    and critic; a token R ignores gets 0 from both (so its factor is undefined, not 1)."""
    turns, R, keys = setup(K, L, kind, seed=100 * K + 10 * L + REWARDS.index(kind))
    g_true = turns.true_gradient(R)                                           # (n, A)
    decisive = torch.zeros(turns.n, dtype=torch.bool)
    decisive[sum(keys, [])] = True
    assert (g_true[decisive].abs().amax(1) > 1e-5).all()                      # a signal to scale
    assert (g_true[~decisive].abs() < 1e-12).all()
    for critic in ("perfect", "boundary"):
        for lam_intra in (0.95, 1.0):
            for beta in BETAS:
                g = turns.update(turns.advantages(R, critic, beta, lam_intra), turns.w)
                f = closed_form(L, beta, lam_intra, critic).repeat(K)         # (n,)
                err = (g - f[:, None] * g_true).abs().max()
                assert err < 1e-9, (critic, lam_intra, beta, float(err))


def test_the_quoted_factors_and_where_the_two_critics_agree():
    """The issue's numbers (L = 4, λ_intra = 0.95, β = 1; L = 16) and two identities: at λ_intra
    = 1 the boundary critic's correction is 0 (A ≡ C in expectation); on the last token the two
    factors are equal (a boundary critic is a perfect one for a key at the turn's end)."""
    assert torch.allclose(closed_form(4, 1.0, 0.95, "perfect"),
                          torch.tensor([1.75, 1.5125, 1.286875, 1.07253125], dtype=torch.float64))
    f16 = closed_form(16, 1.0, 0.95, "perfect")
    assert (round(float(f16[0]), 2), round(float(f16[-1]), 2)) == (1.94, 1.3)
    assert torch.equal(closed_form(6, 1.0, 1.0, "boundary"), torch.ones(6, dtype=torch.float64))
    for L in range(2, 17):
        assert abs(closed_form(L, 1.0, 0.95, "perfect")[-1]
                   - closed_form(L, 1.0, 0.95, "boundary")[-1]) < 1e-12
    # the boundary factor averages 1 over a turn; the perfect one more (1.40 at L = 4)
    assert abs(closed_form(4, 1.0, 0.95, "boundary").mean() - 1) < 1e-12
    assert abs(closed_form(4, 1.0, 0.95, "perfect").mean() - 1.4055) < 1e-4


def test_whitening_over_the_enumerated_distribution_is_a_common_rescale():
    """(M5) over a batch that is π_old exactly (each sequence repeated in proportion to its
    probability, p = 3/4, 1/4): the batch mean drops out (E[∂ log π] = 0) and every token's
    update is divided by the same s, the std of A^MAE over the batch's tokens. So the factors
    keep their profile; β = 1 against β = 0, both whitened, is factor × s(0)/s(1)."""
    K, L, keys = 2, 4, [[0], [5]]
    n_act = [2 if p in (0, 5, 2, 7) else 1 for p in range(K * L)]           # keys and two free
    turns = Turns(K, L, n_act, 0, probs=[[0.75, 0.25]] * (K * L))
    R = reward("one", turns.ys, keys, 0)
    rows = torch.repeat_interleave(torch.arange(turns.N), (turns.w * 4 ** 4).round().long())
    assert len(rows) == 4 ** 4 and torch.allclose(turns.w, torch.bincount(rows).double() / 256)
    g_true, s = turns.true_gradient(R), {}
    for critic in ("perfect", "boundary"):
        for beta in BETAS:
            V = turns.values(R, critic)[rows]
            args = mpo.outcome_rewards(R[rows], turns.tid[rows]), V, turns.tid[rows]
            raw, _ = mpo.mpo_advantages(*args, lam=LAM, lam_intra=0.95, beta=beta, whiten=False)
            white, _ = mpo.mpo_advantages(*args, lam=LAM, lam_intra=0.95, beta=beta)
            a = raw[:, turns.act]
            s[critic, beta] = float((a.var() + 1e-8).sqrt())                  # unbiased, as (M5)
            g = turns.update(white, torch.full((len(rows),), 1 / len(rows)), rows)
            f = closed_form(L, beta, 0.95, critic).repeat(K)
            assert (g - f[:, None] * g_true / s[critic, beta]).abs().max() < 1e-9
    got = {k: round(v, 4) for k, v in s.items()}
    assert got == {("perfect", 0.0): 0.2488, ("perfect", 0.5): 0.2538, ("perfect", 1.0): 0.2681,
                   ("boundary", 0.0): 0.2488, ("boundary", 0.5): 0.2489,
                   ("boundary", 1.0): 0.2491}, got
    rel = closed_form(L, 1.0, 0.95, "perfect") * s["perfect", 0.0] / s["perfect", 1.0]
    assert [round(float(x), 3) for x in rel] == [1.624, 1.404, 1.194, 0.995], rel


def test_signal_to_noise_of_the_key_token():
    """Per-token SNR, mean / std over episodes of A_key · ∂ log π(y_key)/∂θ (θ the right action's
    logit), K = 3 turns of L = 4, one binary key per turn on its first token, p = 1/2, perfect
    critic. A_key = c·δ_key + λ A^turn_{t+1}, c = 1 + β(1 − w_1): β scales the key's own term,
    not the later turns' noise, so SNR(β)/SNR(0) <= c (1.75 here); the last turn has no noise."""
    K, L, keys = 3, 4, [[0], [4], [8]]
    turns = Turns(K, L, [2 if p % L == 0 else 1 for p in range(K * L)], 0,
                  probs=[[0.5, 0.5]] * (K * L))
    R = reward("one", turns.ys, keys, 0)
    score = (turns.ys[:, [0, 4, 8]] == 0).double() - 0.5                     # (N, K)
    snr = {}
    for beta in (0.0, 1.0):
        for whiten in (False, True):
            adv = turns.advantages(R, "perfect", beta, 0.95, whiten)[:, turns.act][:, [0, 4, 8]]
            X = adv * score                                                   # (N, K) per episode
            m = (turns.w[:, None] * X).sum(0)
            sd = (turns.w[:, None] * (X - m) ** 2).sum(0).sqrt()
            snr[beta, whiten] = [round(float(x), 3) for x in (m / sd.clamp(min=1e-12))[:2]]
            assert sd[2] < 1e-9 or whiten                                     # last turn: no noise
    assert snr == {(0.0, False): [0.976, 1.25], (1.0, False): [1.708, 2.188],
                   (0.0, True): [0.976, 1.25], (1.0, True): [1.708, 2.188]}, snr
    c = float(closed_form(L, 1.0, 0.95, "perfect")[0])
    assert all(b / a <= c + 1e-3 for a, b in zip(snr[0.0, False], snr[1.0, False]))
