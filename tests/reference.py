"""Loop-based float64 reference implementations, written from the maths for the tests.

Everything here walks rows, turns and tokens with Python floats (IEEE double), one formula at a
time, and deliberately uses no vectorised trick (no cumsum, no scans, no scatter): the vectorised
mpo.py must agree with these loops. Sums like A_t = Σ_k λ^k δ_{t+k} are written as the literal
double sums, not as the backward recursion, so that a wrong recursion in mpo.py cannot be mirrored.

Inputs are torch tensors ([B, T] batch-first, turn_ids = k on the k-th assistant turn, -1
elsewhere); outputs are float64 torch tensors (or Python floats / dicts for the diagnostics).
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def _rows(x: torch.Tensor) -> list[list[float]]:
    return x.detach().to(F64).tolist() if x.is_floating_point() else x.tolist()


def action_positions(turn_ids_row: list[int]) -> list[int]:
    """Columns of the action tokens of one row, left to right."""
    return [p for p, k in enumerate(turn_ids_row) if k >= 0]


def turn_positions(turn_ids_row: list[int]) -> list[list[int]]:
    """turn_positions(row)[k] = columns of turn k (in order)."""
    n = max(turn_ids_row, default=-1) + 1
    out: list[list[int]] = [[] for _ in range(n)]
    for p, k in enumerate(turn_ids_row):
        if k >= 0:
            out[k].append(p)
    return out


def _zeros(B: int, T: int) -> list[list[float]]:
    return [[0.0] * T for _ in range(B)]


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


# --- layout helpers ---------------------------------------------------------------------------------
def turn_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    out = []
    for row in mask.tolist():
        k, prev, ids = -1, False, []
        for m in row:
            m = bool(m)
            if m and not prev:
                k += 1
            ids.append(k if m else -1)
            prev = m
        out.append(ids)
    return torch.tensor(out, dtype=torch.int64)


def outcome_rewards(scores: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    tid = turn_ids.tolist()
    out = _zeros(len(tid), len(tid[0]))
    for b, row in enumerate(tid):
        pos = action_positions(row)
        if pos:
            out[b][pos[-1]] = float(scores[b])
    return _t(out)


# --- MPO equations ----------------------------------------------------------------------------------
def token_td_residuals(rewards, values, turn_ids) -> torch.Tensor:
    """δ_j = r_j + V_{next action token} − V_j (V_next = 0 after the row's last action token)."""
    r, v, tid = _rows(rewards), _rows(values), turn_ids.tolist()
    out = _zeros(len(tid), len(tid[0]))
    for b, row in enumerate(tid):
        pos = action_positions(row)
        for j, p in enumerate(pos):
            v_next = v[b][pos[j + 1]] if j + 1 < len(pos) else 0.0
            out[b][p] = r[b][p] + v_next - v[b][p]
    return _t(out)


def turn_residual_sums(delta, turn_ids, num_turns=None):
    d, tid = _rows(delta), turn_ids.tolist()
    K = num_turns if num_turns is not None else max(max(row) for row in tid) + 1
    out = [[0.0] * K for _ in tid]
    mask = [[False] * K for _ in tid]
    for b, row in enumerate(tid):
        for k, pos in enumerate(turn_positions(row)):
            s = 0.0
            for p in pos:
                s += d[b][p]
            out[b][k] = s
            mask[b][k] = True
    return _t(out), torch.tensor(mask, dtype=torch.bool)


def turn_gae(delta_turn, turn_mask, lam: float) -> torch.Tensor:
    """A_t = Σ_{k≥0} λ^k δ_{t+k} over the row's (masked) turns, as a literal double sum."""
    d, m = _rows(delta_turn), turn_mask.tolist()
    out = [[0.0] * len(r) for r in d]
    for b in range(len(d)):
        turns = [k for k, ok in enumerate(m[b]) if ok]
        for a, t in enumerate(turns):
            s = 0.0
            for c in range(a, len(turns)):
                s += lam ** (c - a) * d[b][turns[c]]
            out[b][t] = s
    return _t(out)


def intra_turn_traces(delta, turn_ids, lam_intra: float) -> torch.Tensor:
    """A^intra_{t,i} = Σ_{j≥i, j in turn t} λ_intra^{j−i} δ_{t,j}."""
    d, tid = _rows(delta), turn_ids.tolist()
    out = _zeros(len(tid), len(tid[0]))
    for b, row in enumerate(tid):
        for pos in turn_positions(row):
            for i in range(len(pos)):
                s = 0.0
                for j in range(i, len(pos)):
                    s += lam_intra ** (j - i) * d[b][pos[j]]
                out[b][pos[i]] = s
    return _t(out)


def mae_projection(adv_turn, adv_intra, turn_ids, beta: float) -> torch.Tensor:
    at, ai, tid = _rows(adv_turn), _rows(adv_intra), turn_ids.tolist()
    out = _zeros(len(tid), len(tid[0]))
    for b, row in enumerate(tid):
        for k, pos in enumerate(turn_positions(row)):
            mean = sum(ai[b][p] for p in pos) / len(pos)
            for p in pos:
                out[b][p] = at[b][k] + beta * (ai[b][p] - mean)
    return _t(out)


def whiten(x, mask, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / sqrt(var + eps) over masked entries; var unbiased (n − 1), 0 when n = 1."""
    xs, ms = _rows(x), mask.tolist()
    vals = [xs[b][p] for b in range(len(xs)) for p in range(len(xs[b])) if ms[b][p]]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1) if n > 1 else 0.0
    out = _zeros(len(xs), len(xs[0]))
    for b in range(len(xs)):
        for p in range(len(xs[b])):
            if ms[b][p]:
                out[b][p] = (xs[b][p] - mean) / math.sqrt(var + eps)
    return _t(out)


def multiscale_lambda_returns(rewards, values, turn_ids, lam: float, lam_intra: float) -> torch.Tensor:
    """G_{t,i} = V_{t,i} + Σ_{j=i}^{L_t} λ_intra^{j−i} δ_{t,j} + λ_intra^{L_t−i} λ Σ_{k≥0} λ^k δ^turn_{t+1+k},
    every sum written out from the token residuals δ (no A^turn or A^intra reused)."""
    d, v, tid = _rows(token_td_residuals(rewards, values, turn_ids)), _rows(values), turn_ids.tolist()
    out = _zeros(len(tid), len(tid[0]))
    for b, row in enumerate(tid):
        turns = turn_positions(row)
        d_turn = [sum(d[b][p] for p in pos) for pos in turns]
        for t, pos in enumerate(turns):
            later = sum(lam ** k * d_turn[t + 1 + k] for k in range(len(turns) - t - 1))
            L = len(pos)
            for i in range(L):                       # i is 0-based here: L_t − i becomes L − 1 − i
                trace = sum(lam_intra ** (j - i) * d[b][pos[j]] for j in range(i, L))
                out[b][pos[i]] = v[b][pos[i]] + trace + lam_intra ** (L - 1 - i) * lam * later
    return _t(out)


def mpo_advantages(rewards, values, turn_ids, lam=0.8, lam_intra=0.95, beta=1.0, whiten_=True,
                   critic_target="mae"):
    delta = token_td_residuals(rewards, values, turn_ids)
    K = max(1, int(turn_ids.max()) + 1)
    dturn, tmask = turn_residual_sums(delta, turn_ids, K)
    aturn = turn_gae(dturn, tmask, lam)
    aintra = intra_turn_traces(delta, turn_ids, lam_intra)
    adv = mae_projection(aturn, aintra, turn_ids, beta)
    mask = turn_ids >= 0
    v = torch.where(mask, values.to(F64), torch.zeros((), dtype=F64))
    returns = torch.where(mask, v + adv, torch.zeros((), dtype=F64))
    if critic_target == "lambda_return":
        returns = multiscale_lambda_returns(rewards, values, turn_ids, lam, lam_intra)
    if whiten_:
        adv = whiten(adv, mask)
    return adv, returns


# --- baselines --------------------------------------------------------------------------------------
def _action_deltas(rewards, values, action_mask, gamma=1.0):
    """Each row's action positions and their δ_j = r_j + γ V_{j+1} − V_j over consecutive action
    tokens (observations skipped; V past the row's last action token is 0)."""
    r, v = _rows(rewards), _rows(values)
    m = [[bool(x) for x in row] for row in action_mask.tolist()]
    rows = []
    for b in range(len(m)):
        pos = [p for p in range(len(m[b])) if m[b][p]]
        rows.append((pos, [r[b][p] + gamma * (v[b][pos[j + 1]] if j + 1 < len(pos) else 0.0)
                           - v[b][p] for j, p in enumerate(pos)]))
    return v, m, rows


def token_gae(rewards, values, action_mask, lam=0.95, gamma=1.0, whiten_=True):
    """PPO GAE over the action tokens of each row only (observations skipped):
    δ_j = r_j + γ V_{j+1} − V_j over consecutive action tokens, A_j = Σ_k (γλ)^k δ_{j+k}."""
    v, m, rows = _action_deltas(rewards, values, action_mask, gamma)
    adv, ret = _zeros(len(m), len(m[0])), _zeros(len(m), len(m[0]))
    for b, (pos, deltas) in enumerate(rows):
        for j, p in enumerate(pos):
            s = 0.0
            for c in range(j, len(pos)):
                s += (gamma * lam) ** (c - j) * deltas[c]
            adv[b][p] = s
            ret[b][p] = v[b][p] + s
    adv_t = _t(adv)
    if whiten_:
        adv_t = whiten(adv_t, torch.tensor(m))
    return adv_t, _t(ret)


def vapo_advantages(rewards, values, action_mask, alpha=0.05, critic_lam=1.0, whiten_=True):
    """VAPO: per row λ_b = min(1, max(0, 1 − 1/(α l_b))), l_b = the row's action tokens;
    A_j = Σ_k λ_b^k δ_{j+k}, returns_j = V_j + Σ_k critic_lam^k δ_{j+k} (γ = 1, observations skipped)."""
    v, m, rows = _action_deltas(rewards, values, action_mask)
    adv, ret = _zeros(len(m), len(m[0])), _zeros(len(m), len(m[0]))
    for b, (pos, deltas) in enumerate(rows):
        lam = min(1.0, max(0.0, 1.0 - 1.0 / (alpha * len(pos)))) if pos else 0.0
        for j, p in enumerate(pos):
            adv[b][p] = sum(lam ** (c - j) * deltas[c] for c in range(j, len(pos)))
            ret[b][p] = v[b][p] + sum(critic_lam ** (c - j) * deltas[c] for c in range(j, len(pos)))
    adv_t = _t(adv)
    if whiten_:
        adv_t = whiten(adv_t, torch.tensor(m))
    return adv_t, _t(ret)


def grpo_advantages(scores, group_ids, turn_ids, eps=1e-6, scale=True) -> torch.Tensor:
    s, g, tid = [float(x) for x in scores.tolist()], group_ids.tolist(), turn_ids.tolist()
    out = _zeros(len(tid), len(tid[0]))
    for b, row in enumerate(tid):
        members = [s[c] for c in range(len(s)) if g[c] == g[b]]
        n = len(members)
        if n == 1:
            a = 0.0
        else:
            mean = sum(members) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
            a = (s[b] - mean) / (std + eps) if scale else s[b] - mean
        for p in action_positions(row):
            out[b][p] = a
    return _t(out)


# --- ratios and losses ------------------------------------------------------------------------------
def token_ratios(logp, old_logp, turn_ids, level: str, max_log_ratio: float = 20.0) -> torch.Tensor:
    """The forward ratio used for each action token (0 elsewhere).
    turn: exp(clamp(Σ_turn lr)); token: exp(clamp(lr)); sequence: exp(clamp(mean_row lr))."""
    lp, olp, tid = _rows(logp), _rows(old_logp), turn_ids.tolist()
    out = _zeros(len(tid), len(tid[0]))

    def clamp(x):
        return max(-max_log_ratio, min(max_log_ratio, x))

    for b, row in enumerate(tid):
        if level == "turn":
            for pos in turn_positions(row):
                s = sum(lp[b][p] - olp[b][p] for p in pos)
                for p in pos:
                    out[b][p] = math.exp(clamp(s))
        elif level == "token":
            for p in action_positions(row):
                out[b][p] = math.exp(clamp(lp[b][p] - olp[b][p]))
        elif level == "sequence":
            pos = action_positions(row)
            if pos:
                s = sum(lp[b][p] - olp[b][p] for p in pos) / len(pos)
                for p in pos:
                    out[b][p] = math.exp(clamp(s))
        else:
            raise ValueError(level)
    return _t(out)


def policy_loss(logp, old_logp, advantages, turn_ids, clip_eps=0.2, level="turn",
                clip_eps_high=None, dual_clip=None, num_tokens=None, max_log_ratio=20.0):
    """Returns (loss, grad_wrt_logp, clipped_mask) for
    loss = Σ_action max(−ρA, −clip(ρ, 1−ε, 1+ε_high)A) / N (dual clip: min(that, −cA) for A < 0).
    The gradient uses the stop-gradient rule: d term_p / d logp_p = −ρ_p A_p on the unclipped branch
    (ρ_p = the forward ratio of token p), 0 on a clipped / dual-clipped branch."""
    eh = clip_eps if clip_eps_high is None else clip_eps_high
    rho = _rows(token_ratios(logp, old_logp, turn_ids, level, max_log_ratio))
    A, tid = _rows(advantages), turn_ids.tolist()
    n_act = sum(1 for row in tid for k in row if k >= 0)
    N = n_act if num_tokens is None else num_tokens
    total = 0.0
    grad = _zeros(len(tid), len(tid[0]))
    clipped = [[False] * len(tid[0]) for _ in tid]
    for b, row in enumerate(tid):
        for p in action_positions(row):
            r, a = rho[b][p], A[b][p]
            rc = min(max(r, 1.0 - clip_eps), 1.0 + eh)
            unclipped, clip_term = -r * a, -rc * a
            term, g = (unclipped, -r * a) if unclipped >= clip_term else (clip_term, 0.0)
            clipped[b][p] = clip_term > unclipped
            if dual_clip is not None and a < 0 and -dual_clip * a < term:
                term, g = -dual_clip * a, 0.0
            total += term
            grad[b][p] = g / N
    return total / N, _t(grad), torch.tensor(clipped)


def value_loss(values, old_values, returns, turn_ids, clip=None, num_tokens=None) -> float:
    v, ov, R, tid = _rows(values), _rows(old_values), _rows(returns), turn_ids.tolist()
    total, n = 0.0, 0
    for b, row in enumerate(tid):
        for p in action_positions(row):
            e = (v[b][p] - R[b][p]) ** 2
            if clip is not None:
                vc = ov[b][p] + min(max(v[b][p] - ov[b][p], -clip), clip)
                e = max(e, (vc - R[b][p]) ** 2)
            total += e
            n += 1
    return 0.5 * total / (n if num_tokens is None else num_tokens)


# --- diagnostics ------------------------------------------------------------------------------------
def _var_pop(xs):
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


def explained_variance(values, returns, turn_ids) -> float:
    v, R, tid = _rows(values), _rows(returns), turn_ids.tolist()
    res, rets = [], []
    for b, row in enumerate(tid):
        for p in action_positions(row):
            res.append(R[b][p] - v[b][p])
            rets.append(R[b][p])
    return 1.0 - _var_pop(res) / _var_pop(rets)


def quantile_linear(xs, q) -> float:
    """torch.quantile's default ('linear'): position q (n − 1) in the sorted values."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def median(xs) -> float:
    """The usual median: the middle value, or the mean of the two middle values for an even count."""
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def turn_value_structure(values, turn_ids) -> dict:
    """Rows with >= 2 turns and non-constant values enter every statistic; others are counted."""
    if isinstance(values, (list, tuple)):
        pairs = list(zip(values, turn_ids))
    else:
        pairs = [(values, turn_ids)]
    share_tok, share_eq, exceeds, jump_exceeds = [], [], [], []
    sq_all = sq_boundary = 0.0
    n_turns = n_single = n_constant = 0
    for vals_t, tid_t in pairs:
        v, tid = _rows(vals_t), tid_t.tolist()
        for b, row in enumerate(tid):
            turns = turn_positions(row)
            pos = action_positions(row)
            if len(turns) == 1:
                n_single += 1
            if len(turns) < 2:
                continue
            vals = [v[b][p] for p in pos]
            if max(vals) == min(vals):
                n_constant += 1
                continue
            for j in range(len(pos) - 1):                 # adjacent action tokens, obs skipped
                d2 = (v[b][pos[j + 1]] - v[b][pos[j]]) ** 2
                sq_all += d2
                if row[pos[j + 1]] != row[pos[j]]:
                    sq_boundary += d2
            n_turns += len(turns)
            vbar = sum(vals) / len(vals)
            means = [sum(v[b][p] for p in t) / len(t) for t in turns]
            between = sum(len(t) * (m - vbar) ** 2 for t, m in zip(turns, means))
            total = sum((x - vbar) ** 2 for x in vals)
            within = sum((v[b][p] - m) ** 2 for t, m in zip(turns, means) for p in t)
            share_tok.append(between / total)
            var_between = _var_pop(means)
            mean_within = sum(_var_pop([v[b][p] for p in t]) for t in turns) / len(turns)
            share_eq.append(var_between / (var_between + mean_within))
            exceeds.append(1.0 if between > within else 0.0)
            jumps = [abs(v[b][turns[k + 1][0]] - v[b][turns[k][-1]]) for k in range(len(turns) - 1)]
            spans = [quantile_linear([v[b][p] for p in t], 0.95)
                     - quantile_linear([v[b][p] for p in t], 0.05) for t in turns]
            jump_exceeds.append(1.0 if sum(jumps) / len(jumps) > sum(spans) / len(spans) else 0.0)
    nan = float("nan")
    return {
        "between_share_token_median": median(share_tok) if share_tok else nan,
        "between_share_equal_median": median(share_eq) if share_eq else nan,
        "between_exceeds_within_frac": sum(exceeds) / len(exceeds) if exceeds else nan,
        "boundary_share_sq_changes": sq_boundary / sq_all if sq_all else nan,
        "boundary_jump_exceeds_span_frac": sum(jump_exceeds) / len(jump_exceeds) if jump_exceeds else nan,
        "n_trajectories": len(share_tok),
        "n_turns": n_turns,
        "n_single_turn": n_single,
        "n_constant": n_constant,
    }
