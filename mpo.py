"""MPO: Multi-scale Policy Optimization for long-horizon LLM agents, in one torch-only file.

An agent acts in whole assistant turns (a search query, a tool call, an answer) while its policy
writes token by token. MPO assigns credit at both scales:

  (M1) token TD residuals   delta_{t,i} = r_{t,i} + V_next - V_{t,i}               (§5, step 2)
  (M2) turn residual sums   delta^turn_t = sum_i delta_{t,i}                        (§3)
  (M3) turn-level GAE       A^turn_t = sum_k lam^k delta^turn_{t+k}                 (§3)
  (M4) intra-turn traces    A^intra_{t,i} = sum_{j>=i} lam_intra^(j-i) delta_{t,j}  (§3)
  Eq. (20) MAE projection   A^MAE_{t,i} = A^turn_t + beta (A^intra_{t,i} - mean_i A^intra_{t,i})
  (M5) batch whitening      (A - mean) / sqrt(var + 1e-8) over all action tokens    (§5, step 6)
  (M6) turn ratio           rho~_{t,i} = rho_{t,i} * sg(prod_{j != i} rho_{t,j})    (§3, §5 step 7)
  (M7) clipped surrogate    -min(rho~ A, clip(rho~, 1 - eps, 1 + eps) A), token mean
  (M8) critic loss          1/2 (V - R)^2, token mean, R = V_rollout + A^MAE or the multi-scale
                            λ-return G_{t,i} = V + A^intra + lam_intra^(L_t - i) lam A^turn_{t+1}

followed by the baselines the paper compares against ((B1) PPO token GAE and VAPO's
decoupled-λ variant of it, (B2) GRPO, (B3) GSPO) and the critic diagnostics of its Appendix C.
Eq. (20) is the paper's number; (M1)-(M8) and (B1)-(B3) are this project's labels, listed once
in docs/paper.md. Section numbers (§) are those of the project's paper notes; docs/paper.md
summarises each under the same number.

Symbols: lam = λ (turn GAE), lam_intra = λ_intra (intra-turn trace), beta = β (strength of the
centred correction), delta = δ (TD residual), rho = ρ (importance ratio), eps = ε (clip range),
sg = stop-gradient. Discounting is γ = 1 throughout, as in the paper.

Dimensions: B trajectories (rows), T token positions, K turns (the most turns of any row).

Layout: every per-token tensor is batch-first (B, T). `turn_ids[b, p] = k >= 0` when the policy
generated token p of row b in its k-th assistant turn, -1 everywhere else (prompt, observation,
padding). Turns are contiguous and numbered 0, 1, 2, ... in order. `values[b, p]` is the critic's
value of the prefix *before* token p; `rewards[b, p]` the reward right after emitting it.

Precision: float64 inputs compute in float64; float32 / bfloat16 / float16 inputs compute and
return float32. Validation (on by default, `validate=False` for hot loops) is the only place that
reads tensors back to the host; with it off, nothing here synchronises with the device.

Usage:
    turn_ids = turn_ids_from_mask(action_mask)                 # (B, T)
    rewards = outcome_rewards(scores, turn_ids)                # (B, T)
    adv, ret = mpo_advantages(rewards, values, turn_ids)       # (B, T), (B, T)
    loss, stats = policy_loss(logp, old_logp, adv, turn_ids)   # ratio_level="turn"
"""
from __future__ import annotations

import functools
import math
import numbers

import torch
import torch.nn.functional as F

RATIO_LEVELS = ("turn", "token", "sequence")


# ---------------------------------------------------------------------------------------------
# Blocks of rows. On the CPU the long computations below (validation, mpo_advantages) run on
# blocks of rows of about CPU_BLOCK positions: a block's temporaries stay in the cache and in
# memory the allocator already holds, where a fresh (B, T) temporary streams from DRAM and costs
# a page fault per 4 KiB (docs/benchmarks.md). On other devices one block is the whole batch.
# ---------------------------------------------------------------------------------------------

CPU_BLOCK = 2**19                                  # positions per block: 2 MiB of float32


def _on_cpu(x: torch.Tensor) -> bool:
    """Whether x lives on the CPU, where blocks pay off and reading a number back costs no sync."""
    return x.device.type == "cpu"


def _row_blocks(x: torch.Tensor) -> list[slice]:
    """Slices of x's rows (dim 0) into blocks of about CPU_BLOCK elements on the CPU, else one."""
    if x.dim() < 2 or not _on_cpu(x) or x.shape[0] == 0:
        return [slice(None)]
    rows = max(1, CPU_BLOCK // max(x[0].numel(), 1))
    return [slice(r, r + rows) for r in range(0, x.shape[0], rows)]


def _turn_columns(turn_ids: torch.Tensor, ids: torch.Tensor | None = None) -> int:
    """How many turn columns a per-turn tensor of these rows needs: the most turns of a row
    (1 + the largest id in `ids`, default turn_ids itself, e.g. each row's last turn) read back
    on the CPU, where that costs no sync; T elsewhere, an upper bound that needs no sync."""
    ids = turn_ids if ids is None else ids
    if not _on_cpu(turn_ids) or ids.numel() == 0:
        return turn_ids.shape[1]
    return max(int(ids.max()), -1) + 1


# ---------------------------------------------------------------------------------------------
# Input validation: every public function checks its arguments unless validate=False.
# These checks read values back to the host (one sync per block); they never change a number.
# ---------------------------------------------------------------------------------------------

def _check_tensor(name: str, x, ref: torch.Tensor | None = None, dims: int = 2,
                  ref_name: str = "turn_ids") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(x.shape)}")
    if ref is not None and x.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}")
    if ref is not None and x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}")


_NOT_DIFFERENTIABLE = "{} computes targets in place (advantages, returns), not a differentiable expression"


def _refuse_grad(why: str, **tensors) -> None:
    """ValueError for a tensor argument that requires grad (checked with validate=False too:
    it costs no read); `why` says what the function differentiates, if anything."""
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise ValueError(f"{name} requires grad, but {why}; pass {name}.detach()")


def _any(mask: torch.Tensor) -> bool:
    """bool(mask.any()) for a bool tensor, read as bytes (torch's bool any() is ~10x slower on CPU)."""
    return mask.numel() > 0 and bool(mask.view(torch.uint8).amax())


def _check_float(name: str, x: torch.Tensor, mask=None) -> None:
    """x is floating point and finite where mask is (a (B, T) bool tensor, a list of the masks
    of x's `_row_blocks`, or None: everywhere)."""
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    for i, rs in enumerate(_row_blocks(x)):
        # A sum is finite iff every term is (a NaN or an inf makes it NaN or inf), unless finite
        # terms overflow; so one plain sum clears most blocks. Else mask (junk off the turns is
        # allowed), and y − y is 0 where y is finite and NaN where not: one sum finds a NaN or
        # inf without overflow; then count them.
        if x[rs].numel() == 0 or bool(torch.isfinite(x[rs].sum())):
            continue
        m = None if mask is None else mask[i] if isinstance(mask, list) else mask[rs]
        y = x[rs].clone() if m is None else torch.where(m, x[rs], zero)
        if not bool(torch.isfinite(y.sub_(y).sum())):
            bad = ~torch.isfinite(x)
            if mask is not None:
                bad &= torch.cat(mask) if isinstance(mask, list) else mask
            raise ValueError(f"{name} holds NaN or inf at {int(bad.sum())} action position(s)")


def _turn_runs(row: list[int]) -> list[int]:
    """The ids of a row's runs of equal non-negative ids, in order (for error messages)."""
    return [k for p, k in enumerate(row) if k >= 0 and (p == 0 or row[p - 1] != k)]


def _check_turn_layout(turn_ids: torch.Tensor, first_row: int) -> tuple[int, torch.Tensor]:
    """_check_turn_ids on a block of rows (row numbers in messages count from first_row);
    returns K of the block and its action mask (turn_ids >= 0)."""
    lowest, highest = (int(x) for x in torch.aminmax(turn_ids))
    if lowest < -1:
        raise ValueError("turn_ids holds values below -1; use -1 for non-action positions")
    # A run of equal ids starts where the id differs from the previous position's. The layout is
    # valid iff the runs of each row are numbered 0, 1, 2, ...: then a turn split by -1 (two
    # runs, one id), a gap or a wrong order all show up as a run whose id is not its rank.
    shifted = turn_ids + 1                                                     # (B, T) 0 off turns
    act = shifted.bool()
    starts = act.clone()                                                       # (B, T) a run's first
    if highest <= 254:
        # Compared in bytes (~10x faster than int64): low = id + 1 and the run count mod 256.
        # Exact here: ids −1..254 have distinct low bytes 0..255, so the runs found are the
        # runs; and congruent run counts and ids + 1 are equal until a 256th run, which no
        # id + 1 in [1, 255] matches.
        low = shifted.to(torch.uint8)
        starts[:, 1:] &= low[:, 1:] != low[:, :-1]
        runs = torch.cumsum(starts.view(torch.uint8), dim=1, dtype=torch.uint8)   # rank + 1, mod 256
        bad = torch.ne(low, runs).logical_and_(act)
    else:
        starts[:, 1:] &= turn_ids[:, 1:] != turn_ids[:, :-1]
        rank = torch.cumsum(starts, dim=1, dtype=torch.int32).sub_(1)          # (B, T) run number
        bad = torch.ne(turn_ids, rank).logical_and_(act)
    if _any(bad):
        b = int(bad.any(dim=1).nonzero()[0])       # the first bad row: say what is wrong with it
        ids = _turn_runs(turn_ids[b].tolist())
        if len(set(ids)) < len(ids):
            raise ValueError("turn_ids: a turn is split by non-turn tokens (-1); turns must be "
                             f"contiguous (row {first_row + b} has runs numbered {ids[:8]})")
        raise ValueError("turn_ids: turns must appear in order 0, 1, 2, ... in each row, without "
                         f"gaps (row {first_row + b} has runs numbered {ids[:8]})")
    return max(highest, -1) + 1, act


def _check_turn_ids(turn_ids) -> int:
    """Check the turn layout and return K, the most turns of any row (0 if there is none)."""
    return _check_turn_blocks(turn_ids)[0]


def _check_turn_blocks(turn_ids) -> tuple[int, list[torch.Tensor]]:
    """_check_turn_ids, also returning the action mask of each of turn_ids' `_row_blocks`."""
    _check_tensor("turn_ids", turn_ids)
    if turn_ids.dtype.is_floating_point or turn_ids.dtype == torch.bool or turn_ids.is_complex():
        raise TypeError(f"turn_ids must be an integer tensor (int64), got {turn_ids.dtype}")
    B, T = turn_ids.shape
    if B == 0 or T == 0:                           # an empty batch: valid, no turn
        return 0, [turn_ids[rs] >= 0 for rs in _row_blocks(turn_ids)]
    checked = [_check_turn_layout(turn_ids[rs], rs.start or 0) for rs in _row_blocks(turn_ids)]
    return max(k for k, _ in checked), [act for _, act in checked]


def _check_number(name: str, x, ok, what: str) -> float:
    """x as a Python float: a Python, numpy or one-element 0-dim torch real number (not a bool)."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 0 or x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"{name} must be a real number or a 0-dim real tensor, got a "
                            f"{x.dtype} tensor of shape {tuple(x.shape)}")
        x = x.item()                               # one host read; validation only
    elif isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    x = float(x)
    if not ok(x):                                  # NaN fails every comparison
        raise ValueError(f"{name} must be {what}, got {x!r}")
    return x


def _check_unit(name: str, x) -> float:
    return _check_number(name, x, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def _check_beta(beta) -> float:
    return _check_number("beta", beta, lambda v: 0.0 <= v < math.inf, "a finite number >= 0")


def _check_max_log_ratio(max_log_ratio) -> float:
    return _check_number("max_log_ratio", max_log_ratio, lambda v: 0.0 < v < math.inf,
                         "a finite number > 0 (the clamp of a log-ratio before exp)")


def _check_num_tokens(num_tokens, act: torch.Tensor) -> None:
    """num_tokens: None, or a whole number >= 1 and >= this batch's own action-token count."""
    what = "a whole number >= 1: the action-token count of the full batch (None: this batch's)"
    if isinstance(num_tokens, torch.Tensor):
        if num_tokens.numel() != 1 or num_tokens.is_complex() or num_tokens.dtype == torch.bool:
            raise TypeError(f"num_tokens must be {what}, got a tensor of shape "
                            f"{tuple(num_tokens.shape)}")
        num_tokens = num_tokens.item()
    elif isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Real):
        raise TypeError(f"num_tokens must be {what}, got {type(num_tokens).__name__}")
    if not (math.isfinite(num_tokens) and num_tokens >= 1 and float(num_tokens).is_integer()):
        raise ValueError(f"num_tokens must be {what}, got {num_tokens!r}")
    if num_tokens < int(act.sum()):
        raise ValueError(f"num_tokens={num_tokens!r} is below this batch's own {int(act.sum())} "
                         "action tokens; pass the count of the whole (accumulated) batch")


def _validate_rewards_values(rewards, values, turn_ids) -> int:
    """Check (rewards, values, turn_ids) of the advantage functions; return K."""
    K, acts = _check_turn_blocks(turn_ids)
    _check_tensor("rewards", rewards, turn_ids)
    _check_tensor("values", values, turn_ids)
    _check_float("rewards", rewards, acts)
    _check_float("values", values, acts)
    for rs, act in zip(_row_blocks(turn_ids), acts):
        # |r| summed off the turns is 0 iff every such reward is 0 (a NaN there makes it NaN)
        off = (~act).view(torch.uint8).to(rewards.dtype)
        if bool(rewards[rs].abs().mul_(off).sum() != 0):
            raise ValueError("rewards must be 0 off action positions (turn_ids == -1); "
                             "put a reward on the action token that earned it")
    return K


def _validate_logps(logp, old_logp, turn_ids) -> None:
    """Check (logp, old_logp, turn_ids) of the ratio and loss functions."""
    _check_turn_ids(turn_ids)
    _check_tensor("logp", logp, turn_ids)
    _check_tensor("old_logp", old_logp, turn_ids)
    _check_float("logp", logp, turn_ids >= 0)
    _check_float("old_logp", old_logp, turn_ids >= 0)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# The one loop primitive: a reverse linear recurrence solved in log2(T) vectorised steps.
# ---------------------------------------------------------------------------------------------

def _reverse_scan(b: torch.Tensor, a: torch.Tensor, scratch: bool):
    """reverse_scan; with scratch=True it may overwrite b and a (the caller's temporaries).

    b may have more leading dimensions than a (several recurrences with the same decays, e.g.
    (2, B, T) with a (B, T)): the decays' products are then formed once for all of them.

    Each step writes into a second buffer (x_i + a_i x_{i+d} reads x_{i+d}, which the step also
    updates), so the products are formed straight into their destination, without temporaries.
    """
    n, d = b.shape[-1], 1
    if n <= 1:
        return b if scratch else b.clone()
    x_in, a_in = b.contiguous(), a.contiguous()
    x_out, a_out = torch.empty_like(x_in), torch.empty_like(a_in)
    while d < n:
        torch.addcmul(x_in[..., :-d], a_in[..., :-d], x_in[..., d:], out=x_out[..., :-d])
        x_out[..., -d:] = x_in[..., -d:]                # complete: their sums reach the end
        reuse = scratch or d > 1                        # b and a are the caller's unless scratch
        if 2 * d < n:                                   # a_i = a_i...a_{i+2d-1}; for i >= n - d
            torch.mul(a_in[..., :-d], a_in[..., d:], out=a_out[..., :-d])   # the window passes the
            a_in, a_out = a_out, a_in if reuse else torch.empty_like(a_in)  # end: never read again
        x_in, x_out = x_out, x_in if reuse else torch.empty_like(x_in)
        d *= 2
    return x_in


def _padded_buffer(shape, n: int, pad: int, dtype, device) -> torch.Tensor:
    """An empty (*shape, n + pad) buffer whose last `pad` entries are 0, for `_scan_padded`."""
    buf = torch.empty(*shape, n + pad, dtype=dtype, device=device)
    buf[..., n:] = 0
    return buf


def _scan_padded(x_in: torch.Tensor, a_in: torch.Tensor, n: int, span: int) -> torch.Tensor:
    """`_reverse_scan` of the first n entries of buffers made by `_padded_buffer` with
    pad >= span: x_in (..., n + pad), a_in (n + pad) or x_in's shape. span (<= n): an upper
    bound on the length of the segments a cuts (runs of non-zero decays, plus one):
    ⌈log2 span⌉ doubling steps then reach every segment's end, instead of ⌈log2 n⌉.

    Past n both are 0, so each doubling step is one full-length multiply-add (x_i + a_i · 0 at
    the end: the sums that are complete stay as they are) and one multiply, with no copy of the
    completed tail and no new slices of the buffers' first n entries. Overwrites both; returns
    a view (..., n) of one of them. The fused body's scans run here (`_mpo_rows`).
    """
    def pair(buf):                                      # a buffer and its first n entries
        return buf, buf[..., :n]
    x_out = _padded_buffer(x_in.shape[:-1], n, x_in.shape[-1] - n, x_in.dtype, x_in.device)
    a_out = _padded_buffer(a_in.shape[:-1], n, a_in.shape[-1] - n, a_in.dtype, a_in.device)
    (x, x_head), (x2, x2_head) = pair(x_in), pair(x_out)
    (a, a_head), (a2, a2_head) = pair(a_in), pair(a_out)
    d = 1
    while d < span:
        torch.addcmul(x_head, a_head, x[..., d:n + d], out=x2_head)   # x_i + a_i x_{i+d}
        if 2 * d < span:                                # a_i = a_i...a_{i+2d-1} (0 past the end)
            torch.mul(a_head, a[..., d:n + d], out=a2_head)
            (a, a_head), (a2, a2_head) = (a2, a2_head), (a, a_head)
        (x, x_head), (x2, x2_head) = (x2, x2_head), (x, x_head)
        d *= 2
    return x_head


def reverse_scan(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Solve x_i = b_i + a_i * x_{i+1} (x past the end = 0) along the last dimension.

    Every GAE in this file is this recurrence: `b` is the residual and `a` the decay linking
    position i to i + 1 (λ inside a segment, 0 where a segment ends, 1 to pass through a skipped
    position). Solved by recursive doubling (Hillis & Steele, 1986): after the step with offset d,
    x_i holds the sum over the next 2d positions and a_i the product of their decays, so
    ceil(log2 T) vectorised steps replace a Python loop over T positions. No division, so it is
    as exact as the loop (rounding aside) for any decay, λ = 0 included.

    Example: b = [1, 1, 1], a = [0.5, 0.5, 0.5] -> x = [1.75, 1.5, 1.0].
    """
    return _reverse_scan(b, a, scratch=False)





def _per_turn_sum(x: torch.Tensor, turn_ids: torch.Tensor, num_turns: int) -> torch.Tensor:
    """Sum x over the tokens of each turn: (B, T) -> (B, num_turns). Non-turn positions dropped."""
    B = x.shape[0]
    idx = torch.where(turn_ids >= 0, turn_ids, num_turns)                      # -1 -> spare column
    out = torch.zeros(B, num_turns + 1, dtype=x.dtype, device=x.device)
    return out.scatter_add_(1, idx, x)[:, :num_turns]                          # (B, K)


def _gather_turn(x_turn: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-turn tensor (B, K) to the tokens of each turn (B, T); 0 off turns."""
    K = x_turn.shape[1]
    idx = torch.where(turn_ids >= 0, turn_ids, K)                              # -1 -> spare column
    return torch.gather(F.pad(x_turn, (0, 1)), 1, idx)                         # (B, T), K = 0 too


def _next_action_value(v: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    """V_next[b, p] = v at the first action position after p in row b, 0 if there is none."""
    B, T = act.shape
    pos = torch.arange(T, device=act.device).expand(B, T)
    idx = torch.where(act, pos, T)                                            # T means "none"
    first_from = torch.flip(torch.cummin(torch.flip(idx, [1]), dim=1).values, [1])   # first >= p
    nxt = F.pad(first_from[:, 1:], (0, 1), value=T)                           # first > p
    return torch.gather(F.pad(v, (0, 1)), 1, nxt)                             # (B, T), 0 past end


# ---------------------------------------------------------------------------------------------
# From a trainer's batch to the paper's quantities
# ---------------------------------------------------------------------------------------------

def turn_ids_from_mask(action_mask: torch.Tensor) -> torch.Tensor:
    """Turn ids from a 0/1 action mask: each maximal run of 1s is the next turn, -1 elsewhere.

    This is how verl and TRL mark multi-turn rollouts (1 = model token, 0 = prompt, tool output,
    padding). Example: [[0, 1, 1, 0, 0, 1, 0]] -> [[-1, 0, 0, -1, -1, 1, -1]].

    Args:
        action_mask: (B, T) bool or integer tensor of 0s and 1s.
    Returns:
        turn_ids: (B, T) int64.
    """
    _check_tensor("action_mask", action_mask)
    if action_mask.dtype != torch.bool:
        if action_mask.is_floating_point() or action_mask.is_complex():
            raise TypeError(f"action_mask must be a bool or integer tensor, got {action_mask.dtype}")
        if bool(((action_mask != 0) & (action_mask != 1)).any()):
            raise ValueError("action_mask must hold only 0 and 1")
    act = action_mask.bool()
    starts = act & ~F.pad(act[:, :-1], (1, 0), value=False)                   # first token of a run
    ids = torch.cumsum(starts.long(), dim=1) - 1                               # (B, T)
    return torch.where(act, ids, torch.full_like(ids, -1))


def outcome_rewards(scores: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    """Place the outcome reward R(τ) of each row on its last action token (§3: 1{t=T} R(τ)).

    Example: scores = [1.0], turn_ids = [[-1, 0, 0, -1, 1, 1, -1]] -> [[0, 0, 0, 0, 0, 1, 0]].

    Args:
        scores: (B,) float, one outcome score per trajectory.
        turn_ids: (B, T) int64.
    Returns:
        rewards: (B, T), zero except on each row's last action token (rows without turns: zero).
    """
    _check_turn_ids(turn_ids)
    _check_tensor("scores", scores, dims=1)
    if scores.shape[0] != turn_ids.shape[0] or scores.device != turn_ids.device:
        raise ValueError(f"scores must have shape ({turn_ids.shape[0]},) on {turn_ids.device}, "
                         f"got {tuple(scores.shape)} on {scores.device}")
    _check_float("scores", scores)
    B, T = turn_ids.shape
    pos = torch.arange(T, device=turn_ids.device).expand(B, T)
    last = F.pad(torch.where(turn_ids >= 0, pos, -1), (0, 1), value=-1).amax(dim=1)   # (B,)
    rewards = torch.zeros(B, T + 1, dtype=scores.dtype, device=scores.device)  # spare column T
    rewards.scatter_(1, torch.where(last >= 0, last, T)[:, None], scores[:, None])
    return rewards[:, :T]


# ---------------------------------------------------------------------------------------------
# (M1) Token TD residuals and (M2) their per-turn sums
# ---------------------------------------------------------------------------------------------

def token_td_residuals(rewards: torch.Tensor, values: torch.Tensor, turn_ids: torch.Tensor,
                       *, validate: bool = True) -> torch.Tensor:
    """(M1): token TD residuals δ_{t,i} = r_{t,i} + V_next − V_{t,i} (γ = 1).

    V_next is the value at the row's next *action* token: inside a turn V_{t,i+1}; on a turn's
    last token V_{t+1,1}, the value after the environment's observation; after the row's last
    action token 0 (the episode has ended). Observation, prompt and padding positions get δ = 0
    and their values are never read.

    Args:
        rewards: (B, T) float, non-zero only at action positions.
        values: (B, T) float, V_{t,i} at action positions.
        turn_ids: (B, T) int64.
    Returns:
        delta: (B, T).
    """
    if validate:
        _validate_rewards_values(rewards, values, turn_ids)
    dtype = _compute_dtype(values)
    act = turn_ids >= 0
    zero = torch.zeros((), dtype=dtype, device=values.device)
    v = torch.where(act, values.to(dtype), zero)                              # (B, T)
    r = torch.where(act, rewards.to(dtype), zero)                             # (B, T)
    return torch.where(act, r + _next_action_value(v, act) - v, zero)         # (B, T)


def turn_residual_sums(delta: torch.Tensor, turn_ids: torch.Tensor, num_turns: int | None = None,
                       *, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(M2): turn residuals δ^turn_t = Σ_i δ_{t,i}, the TD residual of the turn as one macro-action.

    With γ = 1 the sum telescopes (§3): δ^turn_t = Σ_i r_{t,i} + V_{t+1,1} − V_{t,1}, so only the
    critic's values at turn starts enter the turn-level credit.

    Args:
        delta: (B, T) token TD residuals.
        turn_ids: (B, T) int64.
        num_turns: K; default the most turns of any row (reads turn_ids, one host sync). Pass any
            K >= that (e.g. T) to stay sync-free.
    Returns:
        delta_turn: (B, K) with 0 for turns a row does not have.
        turn_mask: (B, K) bool, True where row b has turn k.
    """
    if validate:
        K = _check_turn_ids(turn_ids)
        _check_tensor("delta", delta, turn_ids)
        _check_float("delta", delta, turn_ids >= 0)
        if num_turns is not None and num_turns < K:
            raise ValueError(f"num_turns={num_turns} but turn_ids holds {K} turns")
    if num_turns is None:
        num_turns = int(turn_ids.max().clamp(min=-1)) + 1
    dtype = _compute_dtype(delta)
    act = turn_ids >= 0
    d = torch.where(act, delta.to(dtype), torch.zeros((), dtype=dtype, device=delta.device))
    delta_turn = _per_turn_sum(d, turn_ids, num_turns)                         # (B, K)
    tokens_per_turn = _per_turn_sum(act.to(dtype), turn_ids, num_turns)        # (B, K) L_t
    return delta_turn, tokens_per_turn > 0


# ---------------------------------------------------------------------------------------------
# (M3) Turn-level GAE and (M4) intra-turn traces
# ---------------------------------------------------------------------------------------------

def turn_gae(delta_turn: torch.Tensor, turn_mask: torch.Tensor, lam: float,
             *, validate: bool = True) -> torch.Tensor:
    """(M3): turn-level GAE (§3), A^turn_t = Σ_{k>=0} λ^k δ^turn_{t+k} = δ^turn_t + λ A^turn_{t+1}.

    λ discounts once per *turn*, not once per token: credit crosses a 40-token turn at the cost
    of one λ, where token-level GAE pays λ^40 (§2).

    Example: δ^turn = [0.2, 0.2, 0.3], λ = 0.8 -> A^turn = [0.552, 0.44, 0.3] (§5).

    Args:
        delta_turn: (B, K) turn residuals; turn_mask: (B, K) bool; lam: λ in [0, 1].
    Returns:
        adv_turn: (B, K), 0 where turn_mask is False.
    """
    if validate:
        lam = _check_unit("lam", lam)
        _check_tensor("delta_turn", delta_turn)
        _check_tensor("turn_mask", turn_mask)
        if turn_mask.shape != delta_turn.shape or turn_mask.device != delta_turn.device:
            raise ValueError(f"turn_mask {tuple(turn_mask.shape)} on {turn_mask.device} does not match "
                             f"delta_turn {tuple(delta_turn.shape)} on {delta_turn.device}")
        _check_float("delta_turn", delta_turn, turn_mask.bool())
    mask = turn_mask.bool()
    dtype = _compute_dtype(delta_turn)
    zero = torch.zeros((), dtype=dtype, device=delta_turn.device)
    d = torch.where(mask, delta_turn.to(dtype), zero)                          # (B, K)
    decay = torch.where(mask, torch.full_like(d, lam), zero)                   # λ between turns
    return torch.where(mask, reverse_scan(d, decay), zero)                     # (B, K)


def intra_turn_traces(delta: torch.Tensor, turn_ids: torch.Tensor, lam_intra: float,
                      *, validate: bool = True) -> torch.Tensor:
    """(M4): intra-turn traces (§3), A^intra_{t,i} = Σ_{j=i}^{L_t} λ_intra^{j−i} δ_{t,j}, per turn.

    The local, token-level signal inside turn t; it never crosses a turn boundary (the turn
    GAE carries credit between turns).

    Args:
        delta: (B, T) token TD residuals; turn_ids: (B, T) int64; lam_intra: λ_intra in [0, 1].
    Returns:
        adv_intra: (B, T), 0 off action positions.
    """
    if validate:
        lam_intra = _check_unit("lam_intra", lam_intra)
        _check_turn_ids(turn_ids)
        _check_tensor("delta", delta, turn_ids)
        _check_float("delta", delta, turn_ids >= 0)
    dtype = _compute_dtype(delta)
    act = turn_ids >= 0
    zero = torch.zeros((), dtype=dtype, device=delta.device)
    d = torch.where(act, delta.to(dtype), zero)                                # (B, T)
    next_id = F.pad(turn_ids[:, 1:], (0, 1), value=-1)
    same_turn = act & (next_id == turn_ids)                                    # i+1 in turn t
    decay = torch.where(same_turn, torch.full_like(d, lam_intra), zero)       # 0 ends a turn
    return torch.where(act, reverse_scan(d, decay), zero)                      # (B, T)


# ---------------------------------------------------------------------------------------------
# Eq. (20): the MAE projection
# ---------------------------------------------------------------------------------------------

def mae_projection(adv_turn: torch.Tensor, adv_intra: torch.Tensor, turn_ids: torch.Tensor,
                   beta: float, *, validate: bool = True) -> torch.Tensor:
    """Eq. (20): centred intra-turn correction, A^MAE_{t,i} = A^turn_t + β (A^intra_{t,i} − mean_i A^intra_{t,i}).

    The least-squares projection of β·A^intra_t onto {w : mean_i w_i = A^turn_t} (§6):
    minimise ½ Σ_i (w_i − β A^intra_{t,i})² subject to (1/L_t) Σ_i w_i = A^turn_t; the Lagrange
    condition w_i = β A^intra_{t,i} + μ/L_t with the constraint gives the centred form. Each
    turn keeps its turn-level credit as its mean; tokens keep their relative local differences.

    Args:
        adv_turn: (B, K) A^turn; adv_intra: (B, T) A^intra; turn_ids: (B, T); beta: β >= 0.
    Returns:
        adv_mae: (B, T), 0 off action positions.
    """
    if validate:
        beta = _check_beta(beta)
        K = _check_turn_ids(turn_ids)
        _check_tensor("adv_intra", adv_intra, turn_ids)
        _check_tensor("adv_turn", adv_turn)
        if adv_turn.shape[0] != turn_ids.shape[0] or adv_turn.shape[1] < K:
            raise ValueError(f"adv_turn must have shape ({turn_ids.shape[0]}, >= {K}), "
                             f"got {tuple(adv_turn.shape)}")
        _check_float("adv_intra", adv_intra, turn_ids >= 0)
    dtype = _compute_dtype(adv_intra)
    act = turn_ids >= 0
    K = adv_turn.shape[1]
    intra = torch.where(act, adv_intra.to(dtype), torch.zeros((), dtype=dtype, device=adv_intra.device))
    length = _per_turn_sum(act.to(dtype), turn_ids, K)                         # (B, K) L_t
    mean_intra = _per_turn_sum(intra, turn_ids, K) / length.clamp(min=1)       # (B, K)
    correction = intra - _gather_turn(mean_intra, turn_ids)                    # (B, T) centred
    return _gather_turn(adv_turn.to(dtype), turn_ids) + beta * correction      # (B, T)


# ---------------------------------------------------------------------------------------------
# The critic's regression target R of (M8): the multi-scale λ-return
# ---------------------------------------------------------------------------------------------

def multiscale_lambda_returns(values: torch.Tensor, adv_turn: torch.Tensor, adv_intra: torch.Tensor,
                              turn_ids: torch.Tensor, lam: float, lam_intra: float,
                              *, validate: bool = True) -> torch.Tensor:
    """The critic target G_{t,i} = V_{t,i} + A^intra_{t,i} + λ_intra^(L_t − i) · λ · A^turn_{t+1}.

    A^turn past a row's last turn is 0. It is the λ_intra-return of the tokens of turn t that,
    at the turn's end, bootstraps from the next turn's start value plus λ times its turn-level
    advantage: the A^intra trace of the residuals with λ·A^turn_{t+1} added to the turn's last
    residual. So: at a turn's first token with λ_intra = 1 it is the turn λ-return
    V_{t,1} + A^turn_t (δ^turn_t + λ A^turn_{t+1} = A^turn_t); on the row's last token it is its
    reward (R(τ) with an outcome reward); with λ = λ_intra = 1 it is the Monte Carlo return;
    and it does not depend on β (the alternative, V + A^MAE, does, and with λ_intra = β = 1
    it is the same number A^turn_t + mean_i V_{t,i} on every token of a turn).

    Args:
        values: (B, T) V; adv_turn: (B, K) A^turn; adv_intra: (B, T) A^intra; turn_ids: (B, T);
        lam, lam_intra: λ, λ_intra in [0, 1].
    Returns:
        returns: (B, T), 0 off action positions.
    """
    if validate:
        lam, lam_intra = _check_unit("lam", lam), _check_unit("lam_intra", lam_intra)
        K = _check_turn_ids(turn_ids)
        for name, x in (("values", values), ("adv_intra", adv_intra)):
            _check_tensor(name, x, turn_ids)
            _check_float(name, x, turn_ids >= 0)
        _check_tensor("adv_turn", adv_turn)
        if adv_turn.shape[0] != turn_ids.shape[0] or adv_turn.shape[1] < K:
            raise ValueError(f"adv_turn must have shape ({turn_ids.shape[0]}, >= {K}), "
                             f"got {tuple(adv_turn.shape)}")
    dtype = _compute_dtype(adv_intra)
    act = turn_ids >= 0
    zero = torch.zeros((), dtype=dtype, device=adv_intra.device)
    length = _per_turn_sum(act.to(dtype), turn_ids, adv_turn.shape[1])          # (B, K) L_t
    rank = torch.cumsum(act.to(dtype), dim=1)                                  # (B, T) tokens so far
    after = _gather_turn(torch.cumsum(length, dim=1), turn_ids) - rank         # (B, T) L_t − i
    next_turn = F.pad(adv_turn.to(dtype)[:, 1:], (0, 1))                       # (B, K) A^turn_{t+1}
    decay = torch.pow(torch.full_like(after, lam_intra), after)                # λ_intra^(L_t − i)
    boot = lam * decay * _gather_turn(next_turn, turn_ids)                     # (B, T)
    G = values.to(dtype) + adv_intra.to(dtype) + boot                          # (B, T)
    return torch.where(act, G, zero)


CRITIC_TARGETS = ("mae", "lambda_return")
CLOSED_FORM_LAM_INTRA = 0.99       # `_mpo_rows` sums a turn's traces in closed form up to this λ_intra


# ---------------------------------------------------------------------------------------------
# (M5) Batch whitening (§5, step 6), and the composition: MPO advantages (Algorithm 1)
# ---------------------------------------------------------------------------------------------

def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(M5): standardise x over the positions of mask, (x − mean) / sqrt(var + eps), 0 off mask.

    var is the unbiased (n − 1) variance over all masked positions of the batch, as verl's
    masked_whiten computes it (0 when there is a single position).
    """
    mask = mask.bool()
    x = torch.where(mask, x, torch.zeros_like(x))                              # junk off the mask: ignored
    n = torch.count_nonzero(mask)
    mean = x.sum() / n.clamp(min=1)
    var = torch.where(mask, x - mean, torch.zeros_like(x)).pow(2).sum() / (n - 1).clamp(min=1)
    return torch.where(mask, (x - mean) * torch.rsqrt(var + eps), torch.zeros_like(x))


def _turn_sums(x: torch.Tensor, bounds: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """Σ_{start <= p < end} x[b, p] for every turn: x (B, T) and bounds (B, 2K), each turn's
    (start, end) side by side as `_mpo_rows` finds them -> (B, K).

    Differences of prefix sums, formed in two levels so rounding stays that of a sum over the
    turn's own chunks (not over the whole row): prefix sums inside chunks of `chunk` positions
    in x's dtype, and of whole chunks in float64 (a (B, T / chunk) tensor). A turn the row
    lacks (start = end = T) sums to exactly 0. ~3x cheaper than scatter_add on the CPU.
    """
    B, T = x.shape
    n = T - T % chunk                                          # positions in whole chunks
    local = torch.empty_like(x)                                # (B, T) prefix within each chunk
    torch.cumsum(x[:, :n].view(B, n // chunk, chunk), 2, out=local[:, :n].view(B, n // chunk, chunk))
    torch.cumsum(x[:, n:], 1, out=local[:, n:])                # the last, partial chunk
    acc = torch.float64 if x.device.type != "mps" else x.dtype # MPS has no float64
    before = F.pad(local[:, chunk - 1::chunk].to(acc).cumsum(1), (1, 0))   # (B, chunks) Σ before
    q = bounds - 1                                             # (B, 2K) Σ_{p <= q}, q in [-1, T - 1]
    qc = q.clamp(min=0)
    upto = before.gather(1, torch.div(qc, chunk, rounding_mode="floor")) + local.gather(1, qc)
    upto = torch.where(q >= 0, upto, 0.0)
    return (upto[:, 1::2] - upto[:, 0::2]).to(x.dtype)                     # (B, K)


def _turn_bounds(act: torch.Tensor, inside: torch.Tensor, K: int) -> torch.Tensor:
    """Each turn's first and past-the-last position, side by side (B, 2K), from 0/1 uint8
    masks act (an action token) and inside (p + 1 is in p's turn): T for a turn the row lacks.

    key = (turns begun so far) − act / 2 is k + 1/2 on turn k's tokens and k + 1 between turn k
    and turn k + 1: non-decreasing, so a binary search for k + 1/2 finds turn k's first token
    and one for k + 1 the position after its last. Counted in floating point (a float cumsum
    runs on both threads, an int one does not), exact (halves included) while below 2^23
    (float32), far above any T in float64.
    """
    B, T = act.shape
    kdtype = torch.float32 if T < 2**22 else torch.float64
    first = torch.empty_like(act)                                              # (B, T) 1 at a turn's
    first[:, 0] = act[:, 0]                                                    # first token, else 0
    torch.sub(act[:, 1:], inside[:, :-1], out=first[:, 1:])
    key = torch.cumsum(first, dim=1, dtype=kdtype).sub_(act, alpha=0.5)        # (B, T)
    query = torch.arange(1, 2 * K + 1, dtype=kdtype, device=act.device).div_(2).expand(B, 2 * K)
    return torch.searchsorted(key, query.contiguous())                        # (B, 2K)


SMALL_K = 256                      # up to this many turn columns `_mpo_rows` runs (M3) as a matmul


@functools.lru_cache(maxsize=16)                 # a trainer asks for the same few every step
def _turn_gae_matrix(K: int, lam: float, dtype, device) -> torch.Tensor:
    """W (K, K) with W[j, t] = λ^(j − t) for j >= t, else 0: A^turn = δ^turn @ W is (M3),
    A^turn_t = Σ_{j>=t} λ^(j−t) δ^turn_j, when each row's turns are 0..k − 1 and the columns
    past them hold δ^turn = 0 (as `_turn_sums` gives for a turn the row lacks): the recursion's
    reset at a missing turn then multiplies only zeros. For few turns a (B, K) recursion is
    dominated by its ~25 small ops' fixed cost; the matmul is one (λ = 0: W = I, as 0^0 = 1).
    Cached: the callers only read it."""
    j = torch.arange(K, dtype=dtype, device=device)
    return torch.tril(lam ** (j[:, None] - j[None, :]).clamp_(min=0))         # (K, K) λ^(j − t)


def _mpo_rows(rewards, values, turn_ids, lam, lam_intra, beta, K, span, read_span, critic_target,
              adv, returns):
    """`mpo_advantages` on a block of rows: (M1)–(M4) and Eq. (20) fused, written into `adv`
    (not whitened) and the critic target into `returns`; returns the action mask, Σ adv, the
    action-token count and the scan's bound. span: that bound (see `_reverse_scan`);
    read_span: set it from the block's longest turn (1 if the block has none).

    It computes what the functions above compute (to rounding), with each (B, T) tensor read
    and written as few times as possible: turns are contiguous and in order, so one cumsum and
    a binary search give every turn's first and past-the-last position (B, K), from which come
    L_t, the turn-start values V_{t,1}, V_next at a turn's last token and δ^turn (`_turn_sums`);
    inside a turn V_next is v[p + 1]. The traces' per-turn sums come from (B, K) numbers in
    closed form (step 5), where `mae_projection` sums them. Masks enter arithmetic as 0/1 floats
    (a bool → float cast is slow on the CPU, a byte → float one is not), values off the turns
    (which may be any junk) only through `torch.where`.
    """
    B, T = turn_ids.shape
    dtype, dev = adv.dtype, adv.device
    zero = torch.zeros((), dtype=dtype, device=dev)
    rewards = rewards.to(dtype)                                                # no copy if float32/64
    shifted = torch.empty((B, T), dtype=turn_ids.dtype, device=dev)           # contiguous: flat views
    torch.add(turn_ids, 1, out=shifted)             # (B, T) 0 off turns: gather index, below
    act = shifted.bool()                            # (B, T) turn_ids >= 0, as a cheap cast
    # inside: p + 1 is in p's turn. Compared on the low byte of shifted (byte compares are ~10x
    # faster than int64 ones): it wraps only for turn 255 + 256 j against 0 (off the turns),
    # which the act test excludes; two adjacent turns always differ in it (ids k and k + 1).
    low = shifted.to(torch.uint8)                                              # (B, T)
    inside = torch.empty_like(act)                 # every entry is written just below
    flat_low, flat_act, flat_in = low.view(-1), act.view(-1), inside.view(-1)   # (B T,) views
    torch.eq(flat_low[1:], flat_low[:-1], out=flat_in[:-1])
    flat_in[:-1] &= flat_act[:-1]
    flat_in[:-1] &= flat_act[1:]
    inside[:, -1] = False                          # the flat compare paired it with the next row
    # 1. Turn bounds (B, 2K): each turn's first and past-the-last position
    bounds = _turn_bounds(act.view(torch.uint8), inside.view(torch.uint8), K)  # (B, 2K)
    start, end = bounds[:, 0::2], bounds[:, 1::2]                              # (B, K)
    length = end - start                                                       # (B, K) L_t, 0 if none
    has_turn = length > 0
    if read_span:                                  # the longest turn: ⌈log2⌉ of it scan steps
        span = int(length.max()) if K else 1
    span = max(1, min(T if span is None else int(span), T))                   # no turn is longer
    N = B * T                                      # the scans run on the block as one flat row
    # 2. (M1) δ = r + V_next − V, with v = V masked to 0 off the turns: V_next is v[p + 1] where
    #    p + 1 is in p's turn (`inside`), else 0, plus V_{t+1,1} added on each turn's last token
    #    (0 after the last turn, and for a turn the row lacks, whose index T − 1 is harmless).
    v = torch.where(act, values.to(dtype), zero, out=returns)                 # (B, T) V, 0 off turns
    start_at = start.clamp(max=T - 1)                                          # (B, K) in range
    v_start = torch.where(has_turn, v.gather(1, start_at), zero)              # (B, K) V_{t,1}
    fbuf = _padded_buffer((), N, span, dtype, dev)                             # (N + span,)
    inside_f = fbuf[:N].view(B, T).copy_(inside.view(torch.uint8))             # (B, T) 1 inside, else 0
    dbuf = _padded_buffer((), N, span, dtype, dev)                             # (N + span,)
    delta = torch.sub(rewards, v, out=dbuf[:N].view(B, T))                     # (B, T) r − V
    delta.view(-1)[:-1].addcmul_(inside_f.view(-1)[:-1], v.view(-1)[1:])       # + V_{t,i+1} inside
    last = (end - 1).clamp(0, T - 1)                                           # (B, K) a turn's last
    delta.scatter_add_(1, last, F.pad(v_start[:, 1:], (0, 1)))                 # + V_{t+1,1}; 0 off turns
    # 3. (M2) δ^turn_t = Σ_i δ_{t,i} and (M3) A^turn, on (B, K)
    delta_turn = _turn_sums(delta, bounds)                                    # (B, K)
    if K <= SMALL_K:                               # one matmul instead of ~25 small ops
        adv_turn = delta_turn @ _turn_gae_matrix(K, lam, dtype, dev)          # (B, K)
    else:
        adv_turn = _reverse_scan(delta_turn, has_turn.to(dtype).mul_(lam), scratch=False)
    # 4. (M4) intra-turn traces: the scan with decay λ_intra inside a turn, 0 at its end. The
    #    decay is 0 at every row's last position, so the block scans as one flat row (N,), in
    #    buffers with a zero tail (`_scan_padded`): shifted views of a flat tensor are faster
    #    than of rows, and the zero tail spares a copy per step.
    inside_f.mul_(lam_intra)                                                   # (B, T) the decay
    if critic_target == "mae" or not K:
        adv_intra = _scan_padded(dbuf, fbuf, N, span).view(B, T)               # (B, T)
    else:      # `multiscale_lambda_returns`: G − V is the same trace of the residuals with
        #        λ A^turn_{t+1} added on each turn's last token; both in one scan (shared decays)
        both = _padded_buffer((2,), N, span, dtype, dev)                       # (2, N + span)
        both[0, :N], both[1, :N] = dbuf[:N], dbuf[:N]
        both[1, :N].view(B, T).scatter_add_(1, last, F.pad(adv_turn[:, 1:], (0, 1)).mul_(lam))
        adv_intra, g_minus_v = _scan_padded(both, fbuf, N, span).view(2, B, T)  # (B, T) each
    # 5. Eq. (20): A^MAE = (A^turn_t − β mean_i A^intra_{t,i}) + β A^intra, one gather; the
    #    spare column 0 (turn id −1, shifted by one) gives the non-turn positions their 0.
    #    Σ_i A^intra_{t,i} = Σ_j δ_{t,j} (1 + λ_intra + … + λ_intra^(j−1)) (i = 1..L_t), a geometric
    #    series: (δ^turn_t − λ_intra A^intra_{t,1}) / (1 − λ_intra), from (B, K) numbers. Its
    #    rounding grows like 1 / (1 − λ_intra) (that of the direct sum like L_t): above 0.99
    #    the traces are summed instead (at 0.99, float32: ≤ 1.8x the direct sum's error).
    if lam_intra <= CLOSED_FORM_LAM_INTRA:
        a_first = torch.where(has_turn, adv_intra.gather(1, start_at), zero)    # (B, K) A^intra_{t,1}
        sum_intra = (delta_turn - lam_intra * a_first) / (1 - lam_intra)      # (B, K)
    else:
        sum_intra = _turn_sums(adv_intra, bounds)                              # (B, K)
    mean_intra = sum_intra / length.clamp(min=1)                               # (B, K)
    base = F.pad(adv_turn - beta * mean_intra, (1, 0))                         # (B, 1 + K)
    torch.gather(base, 1, shifted, out=adv).add_(adv_intra, alpha=beta)  # (B, T), 0 off turns
    if critic_target == "mae":
        returns.add_(adv)                                                      # V + A^MAE
    elif K:
        returns.add_(g_minus_v)                                                # G
    return act, adv.sum(), length.sum(), span


def _refuse_max_turn_len(max_turn_len, turn_ids, K):
    longest = int(_per_turn_sum((turn_ids >= 0).long(), turn_ids, K).amax()) if K else 0
    raise ValueError(f"max_turn_len must be a whole number >= the longest turn "
                     f"({longest} tokens), got {max_turn_len!r}")


def mpo_advantages(rewards: torch.Tensor, values: torch.Tensor, turn_ids: torch.Tensor,
                   lam: float = 0.8, lam_intra: float = 0.95, beta: float = 1.0, whiten: bool = True,
                   *, num_turns: int | None = None, max_turn_len: int | None = None,
                   critic_target: str = "mae",
                   validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1: MPO advantages, (M1)–(M4) and Eq. (20) composed, then (M5) whitening (§5).

    Defaults are the paper's reference setting (λ, λ_intra, β) = (0.80, 0.95, 1.00) (§7).
    β = 0 is the "turn GAE only" ablation (every token of a turn gets A^turn_t). The numbers
    are those of the functions above composed (tested to 1e-10 against a loop reference); the
    body (`_mpo_rows`) fuses them so each (B, T) tensor is read and written as few times as
    possible, and on the CPU runs on blocks of rows (`_row_blocks`). Sync-free on a GPU when
    validate=False and num_turns (and max_turn_len, for the shortest scan) are given.

    Args:
        rewards: (B, T) float, non-zero only on action tokens (see `outcome_rewards`).
        values: (B, T) float critic values V_{t,i} (read at action tokens only).
        turn_ids: (B, T) int64.
        lam, lam_intra: λ, λ_intra in [0, 1]; beta: β >= 0; whiten: standardise the advantages.
        num_turns: an upper bound on any row's turn count (e.g. your environment's turn limit).
            Without it the count is read back (validation does; on the CPU, where a read costs
            no sync, the fast path does too); on a GPU with validate=False the turn axis is then
            T wide (no sync, but larger per-turn tensors).
        max_turn_len: an upper bound on any turn's token count (e.g. the generation budget of one
            turn): the intra-turn scan takes ⌈log2 max_turn_len⌉ doubling steps. Without it the
            longest turn is read back where that costs nothing extra (CPU, or validation on);
            on a GPU with validate=False the scan then takes ⌈log2 T⌉ steps.
        critic_target: what `returns` holds, the critic's regression target (the notes leave
            it open): "mae" = values + A^MAE before whitening (PPO's advantages + values with the
            MPO advantage; depends on β); "lambda_return" = `multiscale_lambda_returns`
            (independent of β; measured the better critic target on the testbed, so
            train_min.py uses it; "mae" stays the default here, as the contract fixes it).
    Returns:
        advantages: (B, T) A^MAE (whitened if `whiten`), 0 off action positions.
        returns: (B, T) the critic's regression target (see critic_target), 0 off action positions.
    """
    if critic_target not in CRITIC_TARGETS:
        raise ValueError(f"critic_target must be one of {CRITIC_TARGETS}, got {critic_target!r}")
    _refuse_grad(_NOT_DIFFERENTIABLE.format("mpo_advantages"), rewards=rewards, values=values)
    if validate:
        lam = _check_unit("lam", lam)
        lam_intra = _check_unit("lam_intra", lam_intra)
        beta = _check_beta(beta)
        K = _validate_rewards_values(rewards, values, turn_ids)
        if num_turns is not None and num_turns < K:
            raise ValueError(f"num_turns={num_turns} but turn_ids holds {K} turns")
        if max_turn_len is not None and (isinstance(max_turn_len, bool)
                                         or not isinstance(max_turn_len, numbers.Integral)
                                         or max_turn_len < 1):
            _refuse_max_turn_len(max_turn_len, turn_ids, K)
    else:
        K = None                                   # per block: read on the CPU, else T (no sync)
        lam, lam_intra, beta = (x if isinstance(x, (int, float)) else float(x)   # numpy, 0-dim
                                for x in (lam, lam_intra, beta))
    K = num_turns if num_turns is not None else K
    B, T = turn_ids.shape
    dtype = _compute_dtype(values)
    on_cpu = _on_cpu(values)
    adv = torch.empty(B, T, dtype=dtype, device=values.device)
    returns = torch.empty(B, T, dtype=dtype, device=values.device)
    # Rows are independent until (M5)'s batch statistics, so the fused body runs block by block
    blocks = _row_blocks(turn_ids) if B and T else []                         # empty: nothing to do
    n = torch.zeros((), dtype=dtype, device=values.device)                    # action tokens
    total = torch.zeros((), dtype=dtype, device=values.device)                # Σ A^MAE
    masks = []                                                                 # each block's act
    # Reading the longest turn back costs nothing on the CPU and a sync elsewhere, which
    # validation makes anyway (and needs, to check max_turn_len); without it the intra-turn scan
    # takes ⌈log2 T⌉ steps.
    read_span = validate or (max_turn_len is None and on_cpu)
    longest = 1
    for rs in blocks:
        ids = turn_ids[rs]
        k = K if K is not None else _turn_columns(ids)
        act, total_b, n_b, span = _mpo_rows(rewards[rs], values[rs], ids, lam, lam_intra, beta, k,
                                       max_turn_len, read_span, critic_target, adv[rs],
                                       returns[rs])
        masks.append(act)
        n += n_b
        total += total_b
        longest = max(longest, span) if read_span else longest
    if validate and max_turn_len is not None and max_turn_len < longest:
        _refuse_max_turn_len(max_turn_len, turn_ids, K)
    if whiten:                                     # (M5) over the whole batch, block by block
        mean = total / n.clamp(min=1)
        squares = torch.zeros((), dtype=dtype, device=values.device)
        for rs, act in zip(blocks, masks):
            a = adv[rs]
            a.addcmul_(act.view(torch.uint8), mean, value=-1)                 # centred, still 0 off
            squares += torch.linalg.vector_norm(a).square()
        adv.mul_(torch.rsqrt(squares / (n - 1).clamp(min=1) + 1e-8))
    return adv, returns


# ---------------------------------------------------------------------------------------------
# (M6) The turn-level importance ratio with a stop-gradient, and (M7) the clipped surrogate
# ---------------------------------------------------------------------------------------------

def _last_turns(turn_ids: torch.Tensor) -> torch.Tensor:
    """Each row's last turn id, -1 for a row without turns (B,); turns are numbered in order."""
    if turn_ids.shape[1] == 0:
        return turn_ids.new_full((turn_ids.shape[0],), -1)
    return turn_ids.amax(dim=1)


def _turn_ratios(log_ratio: torch.Tensor, turn_ids: torch.Tensor, act: torch.Tensor,
                 max_log_ratio: float):
    """The turn ratios ρ_t = exp S_t, S_t = Σ_j log_ratio_{t,j} clamped to ±max_log_ratio
    (B, W + 1: 1 for turns a row lacks and in column W, the non-turn positions' spare), each
    position's column (B, T), and each row's last turn id (B,; `_last_turns`). W = K, the most
    turns of a row, on the CPU, where reading it back costs no sync; T on a GPU. Detached: the
    ratios only enter through a stop-gradient or a statistic."""
    last = _last_turns(turn_ids)                                               # (B,)
    W = _turn_columns(turn_ids, last)
    idx = torch.where(act, turn_ids, W)                                        # -1 -> spare column
    S = torch.zeros(log_ratio.shape[0], W + 1, dtype=log_ratio.dtype,
                    device=log_ratio.device).scatter_add_(1, idx, log_ratio.detach())
    return torch.exp(S.clamp_(-max_log_ratio, max_log_ratio)), idx, last      # (B, W + 1), (B, T)


def turn_ratio(logp: torch.Tensor, old_logp: torch.Tensor, turn_ids: torch.Tensor,
               *, max_log_ratio: float = 20.0, validate: bool = True) -> torch.Tensor:
    """(M6): turn ratio with a stop-gradient (§3), ρ̃_{t,i} = ρ_{t,i} · sg(Π_{j≠i} ρ_{t,j}).

    Forward: every token of turn t carries the whole turn's ratio ρ_t = exp Σ_j (logp − old_logp),
    the probability ratio of the turn the environment actually received. Backward: ∂ρ̃_{t,i}/∂logp_{t,i}
    = ρ_t and nothing flows to the other tokens of the turn, so each token's gradient is
    ρ_t A_{t,i} and the centred corrections of Eq. (20) survive. With one shared differentiable
    ρ_t they would cancel: Σ_i A^MAE_{t,i} = L_t A^turn_t (§3).

    Implemented in log space: S_t = Σ_j log_ratio_{t,j} is summed first, so a long turn's
    product never overflows, and clamped to ±max_log_ratio before exp, so ρ̃ ∈ [e^−20, e^20]
    ≈ [2e−9, 4.9e8]; then ρ̃_{t,i} = sg(e^S_t) · (1 + log_ratio_{t,i} − sg(log_ratio_{t,i})),
    whose value is e^S_t and whose derivative in log_ratio_{t,i} is e^S_t. That bounds the
    *ratio*, not the loss: a turn of 96 tokens that each moved by 0.2 nats has ρ_t = e^19.
    PPO's clip removes such a term only when its advantage is positive; for A < 0 the unclipped
    branch −ρ_t A is kept, up to 4.9e8·|A| (and its gradient too), unless `policy_loss` gets a
    `dual_clip` (train_min.py uses 3).

    Args:
        logp, old_logp: (B, T) log-probs of the sampled tokens (current, behaviour).
        turn_ids: (B, T) int64.
        max_log_ratio: > 0, the clamp of S_t before exp.
    Returns:
        ratio: (B, T) float, ρ̃ at action positions, 1 elsewhere.
    """
    max_log_ratio = _check_max_log_ratio(max_log_ratio) if validate else max_log_ratio
    if validate:
        _validate_logps(logp, old_logp, turn_ids)
    act = turn_ids >= 0
    dtype = _compute_dtype(logp)
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    log_ratio = torch.where(act, logp.to(dtype) - old_logp.to(dtype), zero)          # (B, T)
    rho, idx, _ = _turn_ratios(log_ratio, turn_ids, act, max_log_ratio)        # (B, K + 1)
    rho_tok = torch.gather(rho, 1, idx)                                        # (B, T) sg(ρ_t)
    return torch.addcmul(rho_tok, rho_tok, log_ratio - log_ratio.detach())    # (B, T)


def _sequence_ratio(log_ratio: torch.Tensor, act: torch.Tensor, max_log_ratio: float) -> torch.Tensor:
    """(B3): GSPO's sequence ratio s_b = exp(mean of row b's log-ratios) at every position of
    row b (B, T), detached."""
    n = torch.count_nonzero(act, dim=1).unsqueeze(1).clamp(min=1)
    mean = log_ratio.detach().sum(dim=1, keepdim=True) / n
    return torch.exp(mean.clamp_(-max_log_ratio, max_log_ratio)).expand_as(log_ratio).contiguous()


class _Surrogate(torch.autograd.Function):
    """A loss given by its value and its gradient: forward returns `value` (0-dim), backward
    hands `grad` (B, T), ∂loss/∂logp, to logp (scaled by the incoming gradient) and nothing to
    anything else. First derivatives only (no double backward)."""

    @staticmethod
    def forward(ctx, logp, value, grad):
        ctx.save_for_backward(grad)
        ctx.logp_dtype = logp.dtype
        return value.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return (grad * g).to(ctx.logp_dtype), None, None


# GSPO's clip range of the sequence ratio (Zheng et al., 2025, the GSPO paper's experiments:
# 3e-4 below, 4e-4 above); ε = 0.2 on a length-normalised ratio would be about 500x wider.
GSPO_CLIP = (3e-4, 4e-4)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                turn_ids: torch.Tensor, clip_eps: float | None = None, ratio_level: str = "turn", *,
                clip_eps_high: float | None = None, dual_clip: float | None = None,
                num_tokens: int | torch.Tensor | None = None, max_log_ratio: float = 20.0,
                validate: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(M7): clipped surrogate, token mean, L = (1/N) Σ_action max(−ρA, −clip(ρ, 1−ε, 1+ε_high) A).

    ratio_level chooses ρ:
      "turn"     ρ̃_{t,i} of `turn_ratio` (MPO);
      "token"    ρ_{t,i} = exp(logp − old_logp) (PPO, and the "MPO w/ token IS" ablation);
      "sequence" (B3) GSPO-token: s_b = exp(mean of the row's log-ratios) forward, own-token gradient.
    clip_eps (ε): default 0.2 for "turn" and "token"; for "sequence" GSPO's own range,
    ε = 3e-4 and ε_high = 4e-4 (`GSPO_CLIP`), unless you pass clip_eps. `clip_eps_high` (DAPO's
    clip-higher) widens the upper bound (default ε). The loss is a token mean over action
    tokens, N = their count in this batch, or `num_tokens` (pass the count of the whole batch to
    every micro-batch so accumulated gradients equal the full-batch gradient; a whole number
    >= 1). Every log-ratio (a token's, a turn's sum, a row's mean) is clamped to ±max_log_ratio.

    What is bounded: for A > 0 a term's loss is >= −(1 + ε_high)·A and its gradient is zero once
    ρ > 1 + ε_high. For A < 0 PPO keeps the unclipped −ρ·A when ρ > 1 − ε, so the term and its
    gradient grow with ρ up to e^max_log_ratio·|A| (4.9e8·|A|; a turn ratio gets there easily,
    see `turn_ratio`; in float16 that gradient is inf). `dual_clip` = c > 1 (Ye et al., 2020)
    caps such a term at c·|A| with zero gradient once ρ > c: then every term's loss and
    gradient are bounded by max(c, 1 + ε_high)·|A| (per token, before the 1/N).

    The gradient is written out, not left to autograd. Every level's ratio has derivative
    ∂ρ_{b,p}/∂logp_{b,p} = ρ_{b,p} (its own token only: the stop-gradients of (M6) and GSPO-token;
    PPO's exp), so
        ∂L/∂logp_{b,p} = −(1/N) · ρ_{b,p} · A_{b,p}   for a term whose unclipped branch is taken,
                         0                            for a clipped term and off the turns,
    the gradient autograd gives for the max/clamp expression. The loss is built from that (B, T)
    tensor and the value above (`_Surrogate`): its backward is one multiply. Only logp gets a
    gradient (old_logp and advantages must not require one) and only a first derivative.

    Returns:
        loss: 0-dim tensor to minimise.
        stats: detached 0-dim tensors: clip_frac (share of action tokens whose term is clipped),
            turn_clip_frac (share of turns whose turn ratio lies outside the clip range),
            approx_kl (mean of (r − 1) − log r over action tokens, r the token ratio; estimates
            KL(old ‖ new)), ratio_mean and ratio_max of the ratio used. With no action token
            (B = 0, T = 0 or all -1) the loss and every statistic are 0.
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if clip_eps is None and ratio_level == "sequence":                       # GSPO's own range
        clip_eps = GSPO_CLIP[0]
        clip_eps_high = GSPO_CLIP[1] if clip_eps_high is None else clip_eps_high
    elif clip_eps is None:
        clip_eps = 0.2
    if validate:
        _validate_logps(logp, old_logp, turn_ids)
        _check_tensor("advantages", advantages, turn_ids)
        _check_float("advantages", advantages, turn_ids >= 0)
        clip_eps = _check_number("clip_eps", clip_eps, lambda v: 0 < v < math.inf, "> 0")
        if clip_eps_high is not None:
            clip_eps_high = _check_number("clip_eps_high", clip_eps_high,
                                          lambda v: 0 < v < math.inf, "> 0")
        if dual_clip is not None:
            dual_clip = _check_number("dual_clip", dual_clip, lambda v: 1 < v < math.inf,
                                      "> 1 (or None)")
        max_log_ratio = _check_max_log_ratio(max_log_ratio)
        if num_tokens is not None:
            _check_num_tokens(num_tokens, turn_ids >= 0)
    _refuse_grad("policy_loss differentiates logp only", old_logp=old_logp, advantages=advantages)
    eps_low, eps_high = clip_eps, clip_eps if clip_eps_high is None else clip_eps_high
    act = turn_ids >= 0
    dtype = _compute_dtype(logp)
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    # Below, in-place operations reuse buffers: on the CPU every fresh (B, T) buffer is fresh
    # pages, which cost about as much to touch as the arithmetic done in them.
    with torch.no_grad():                         # the value and the gradient, by hand (above)
        log_ratio = torch.sub(logp.to(dtype), old_logp.to(dtype))
        log_ratio = torch.where(act, log_ratio, zero, out=log_ratio)  # (B, T), 0 off the turns
        rho_turn, idx, last = _turn_ratios(log_ratio, turn_ids, act, max_log_ratio)  # (B, K + 1)
        if ratio_level == "turn":                                      # MPO: ρ̃_{t,i} = ρ_t
            ratio = torch.gather(rho_turn, 1, idx)                                # (B, T)
        elif ratio_level == "token":                                   # ρ_{t,i}
            ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio).exp_()         # (B, T)
        else:                                                          # GSPO s_b
            ratio = _sequence_ratio(log_ratio, act, max_log_ratio)                # (B, T)
        neg_A = torch.where(act, advantages.to(dtype), zero).neg_()    # (B, T) −A, 0 off the turns
        loss_unclipped = neg_A * ratio                                 # −ρA
        loss_tok = ratio.clamp(1 - eps_low, 1 + eps_high).mul_(neg_A)  # −clip(ρ)A
        loss_tok = torch.maximum(loss_unclipped, loss_tok, out=loss_tok)
        if dual_clip is not None:            # A < 0: at most c|A| (for A >= 0 the term is <= 0)
            loss_tok = torch.minimum(loss_tok, neg_A.abs_().mul_(dual_clip), out=loss_tok)
        nact = torch.count_nonzero(act).clamp(min=1)   # (a bool .sum() would copy to int64)
        n = nact if num_tokens is None else torch.as_tensor(num_tokens, device=logp.device)
        clipped = loss_tok != loss_unclipped           # terms without a gradient; A = 0 off turns
        grad = loss_unclipped.masked_fill_(clipped, 0).div_(n)         # (B, T) ∂L/∂logp
        value = loss_tok.sum() / n                                     # 0 off the turns: A = 0
    loss = _Surrogate.apply(logp, value, grad)

    with torch.no_grad():
        turn_out = (rho_turn < 1 - eps_low) | (rho_turn > 1 + eps_high)
        n_turns = (last + 1).clamp(min=0).sum()
        if ratio_level == "token":                 # (r − 1) − log r, 0 off the turns (r = 1)
            kl = (ratio - 1).sub_(log_ratio)
        else:
            kl = log_ratio.clamp(-max_log_ratio, max_log_ratio).exp_().sub_(1).sub_(log_ratio)
        ratio_act = torch.where(act, ratio, zero, out=ratio)          # ratio is not needed again
        stats = {
            "clip_frac": torch.count_nonzero(clipped).to(dtype) / nact,
            "turn_clip_frac": torch.count_nonzero(turn_out).to(dtype) / n_turns.clamp(min=1),
            "approx_kl": kl.sum() / nact,
            "ratio_mean": ratio_act.sum() / nact,
            "ratio_max": ratio_act.amax() if ratio_act.numel() else zero.clone(),   # 0 if no token
        }
    return loss, stats


# ---------------------------------------------------------------------------------------------
# (M8) The critic loss
# ---------------------------------------------------------------------------------------------

def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               turn_ids: torch.Tensor, clip: float | None = None, *,
               num_tokens: int | torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """(M8): critic loss, ½ (1/N) Σ_action (V − R)², optionally value-clipped as in PPO.

    With `clip` = c: per token max((V − R)², (V_clip − R)²), V_clip = V_old + clamp(V − V_old, −c, c).
    N as in `policy_loss` (`num_tokens` for gradient accumulation). The targets R are the
    `returns` of `mpo_advantages` (values + A^MAE), read at action tokens.
    """
    if validate:
        _check_turn_ids(turn_ids)
        act = turn_ids >= 0
        for name, x in (("values", values), ("old_values", old_values), ("returns", returns)):
            _check_tensor(name, x, turn_ids)
            _check_float(name, x, act)
        if clip is not None:
            clip = _check_number("clip", clip, lambda v: 0 < v < math.inf, "> 0 or None")
        if num_tokens is not None:
            _check_num_tokens(num_tokens, act)
    act = turn_ids >= 0
    dtype = _compute_dtype(values)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    v = torch.where(act, values.to(dtype), zero)                               # masked first: junk off
    R = torch.where(act, returns.to(dtype), zero)                              # action positions must
    err = (v - R) ** 2                                                          # not reach the gradient
    if clip is not None:
        old = torch.where(act, old_values.to(dtype), zero)
        v_clip = old + (v - old).clamp(-clip, clip)
        err = torch.maximum(err, (v_clip - R) ** 2)
    n = (torch.count_nonzero(act) if num_tokens is None
         else torch.as_tensor(num_tokens, device=values.device))
    return 0.5 * torch.where(act, err, zero).sum() / n.clamp(min=1)


# ---------------------------------------------------------------------------------------------
# Baselines: (B1) PPO token-level GAE and VAPO's variant of it, (B2) GRPO group advantages
# ((B3) GSPO = GRPO advantages with policy_loss(ratio_level="sequence"))
# ---------------------------------------------------------------------------------------------

def _validate_action_mask(rewards, values, action_mask) -> None:
    turn_ids_from_mask(action_mask)                                            # checks the mask
    _check_tensor("rewards", rewards, action_mask, ref_name="action_mask")
    _check_tensor("values", values, action_mask, ref_name="action_mask")
    act = action_mask.bool()
    _check_float("rewards", rewards, act)
    _check_float("values", values, act)
    if bool(((rewards != 0) & ~act).any()):
        raise ValueError("rewards must be 0 off action positions (action_mask == 0)")


def _masked_token_residuals(rewards, values, act, gamma) -> tuple[torch.Tensor, torch.Tensor]:
    """δ_p = r_p + γ V_next − V_p over action tokens (observations skipped), and the masked V."""
    dtype = _compute_dtype(values)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    v = torch.where(act, values.to(dtype), zero)                               # (B, T)
    r = torch.where(act, rewards.to(dtype), zero)                              # (B, T)
    return torch.where(act, r + gamma * _next_action_value(v, act) - v, zero), v


def _token_trace(delta: torch.Tensor, act: torch.Tensor, decay, scratch: bool = False):
    """A_p = δ_p + decay · A_next(p) over action tokens; decay a number or a (B, 1) tensor.
    scratch: delta may be overwritten."""
    decay = torch.as_tensor(decay, dtype=delta.dtype, device=delta.device)
    a = torch.where(act, decay, torch.ones((), dtype=delta.dtype, device=delta.device))  # skip obs
    if not scratch:
        delta = delta.clone()
    return _reverse_scan(delta, a.expand_as(delta), scratch=True).masked_fill_(~act, 0)  # (B, T)


def token_gae(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor,
              lam: float = 0.95, gamma: float = 1.0, whiten: bool = True,
              *, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(B1): PPO token-level GAE over action tokens, A_i = δ_i + γλ A_next, δ_i = r_i + γ V_next − V_i.

    Observation tokens are skipped, as verl's multi-turn GAE does: "next" is the next action
    token, so the environment's reply costs no discount, but every generated token costs one
    γλ, so credit crossing a turn of L tokens decays by λ^L (§2). Returns values + A (before
    whitening) as the critic target; both 0 off the mask.

    Args:
        rewards, values: (B, T) float; action_mask: (B, T) bool or 0/1 integers (1 = action token).
        lam: λ in [0, 1]; gamma: γ in [0, 1]; whiten: standardise over the batch's action tokens.
    """
    _refuse_grad(_NOT_DIFFERENTIABLE.format("token_gae"), rewards=rewards, values=values)
    if validate:
        lam = _check_unit("lam", lam)
        gamma = _check_unit("gamma", gamma)
        _validate_action_mask(rewards, values, action_mask)
    act = action_mask.bool()
    delta, v = _masked_token_residuals(rewards, values, act, gamma)           # (B, T), (B, T)
    adv = _token_trace(delta, act, gamma * lam, scratch=True)                  # (B, T)
    returns = torch.where(act, v + adv, torch.zeros_like(v))
    if whiten:
        adv = masked_whiten(adv, act)
    return adv, returns


def vapo_advantages(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor,
                    alpha: float = 0.05, critic_lam: float = 1.0, whiten: bool = True,
                    *, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """VAPO (Yue et al., 2025): (B1)'s token GAE with decoupled, length-adaptive λ (γ = 1).

    The policy's advantages use, per row b, λ_b = 1 − 1/(α · l_b), l_b = the row's action-token
    count (the response length), clamped to [0, 1] (below l = 1/α = 20 tokens the formula is
    negative; VAPO's responses are thousands of tokens long and never get there); the critic's
    target uses critic_lam (VAPO: 1.0, the Monte Carlo return Σ_{q >= p} r_q, unbiased for the
    value). The rest of VAPO sits in the trainer: value pretraining (the critic fits these
    returns under the initial policy for its first updates, VAPO: 50), clip-higher
    (ε = 0.2, ε_high = 0.28) and the token-mean loss: `policy_loss(ratio_level="token")`.

    Args:
        rewards, values: (B, T) float; action_mask: (B, T) bool or 0/1 integers (1 = action token).
        alpha: α > 0 (VAPO: 0.05); critic_lam: the critic's λ in [0, 1]; whiten: standardise.
    Returns:
        advantages (B, T), whitened if `whiten`; returns (B, T) = values + GAE(critic_lam).
    """
    _refuse_grad(_NOT_DIFFERENTIABLE.format("vapo_advantages"), rewards=rewards, values=values)
    if validate:
        alpha = _check_number("alpha", alpha, lambda v: 0 < v < math.inf, "> 0")
        critic_lam = _check_unit("critic_lam", critic_lam)
        _validate_action_mask(rewards, values, action_mask)
    act = action_mask.bool()
    delta, v = _masked_token_residuals(rewards, values, act, 1.0)             # (B, T), (B, T)
    length = torch.count_nonzero(act, dim=1).unsqueeze(1).to(delta.dtype)    # (B, 1) l_b
    lam = (1 - 1 / (alpha * length.clamp(min=1))).clamp(0, 1)                  # (B, 1) λ_b
    adv = _token_trace(delta, act, lam)                                        # (B, T)
    returns = v + _token_trace(delta, act, critic_lam, scratch=True)          # (B, T), 0 off
    if whiten:
        adv = masked_whiten(adv, act)
    return adv, returns


def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, turn_ids: torch.Tensor,
                    eps: float = 1e-6, scale: bool = True, *, validate: bool = True) -> torch.Tensor:
    """(B2): GRPO, A_b = (R_b − mean_g R) / (std_g R + eps), broadcast to row b's action tokens.

    g is the group of rollouts sharing group_ids[b] (the same prompt). std is the unbiased
    standard deviation, as torch.std; a group of one gets A = 0 (no baseline to compare with).
    scale=False drops the division (Dr. GRPO). Every action token of the row shares one value:
    the coarse, sequence-level credit of §2.

    Args:
        scores: (B,) float; group_ids: (B,) int; turn_ids: (B, T) int64.
    Returns:
        advantages: (B, T), 0 off action positions.
    """
    if validate:
        _check_turn_ids(turn_ids)
        B = turn_ids.shape[0]
        for name, x in (("scores", scores), ("group_ids", group_ids)):
            _check_tensor(name, x, dims=1)
            if x.shape[0] != B or x.device != turn_ids.device:
                raise ValueError(f"{name} must have shape ({B},) on {turn_ids.device}, got {tuple(x.shape)} on {x.device}")
        if group_ids.is_floating_point():
            raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
        _check_float("scores", scores)
    dtype = _compute_dtype(scores)
    R = scores.to(dtype)
    same = (group_ids[:, None] == group_ids[None, :]).to(dtype)               # (B, B)
    n = same.sum(dim=1)                                                        # (B,)
    mean = same @ R / n                                                        # (B,)
    dev2 = (R[None, :] - mean[:, None]) ** 2                                   # (B, B) centred first:
    std = torch.sqrt((same * dev2).sum(dim=1) / (n - 1).clamp(min=1))          # no E[R²] − mean² cancellation
    adv = R - mean
    if scale:
        adv = adv / (std + eps)
    adv = torch.where(n > 1, adv, torch.zeros_like(adv))                       # (B,)
    return torch.where(turn_ids >= 0, adv[:, None], torch.zeros((), dtype=dtype, device=adv.device))


# ---------------------------------------------------------------------------------------------
# Diagnostics: explained variance and the critic's turn structure (Appendix C; §1, §3, §9)
# ---------------------------------------------------------------------------------------------

def explained_variance(values: torch.Tensor, returns: torch.Tensor, turn_ids: torch.Tensor,
                       *, validate: bool = True) -> torch.Tensor:
    """1 − Var(R − V) / Var(R) over action tokens: 1 is a perfect critic, 0 no better than a
    constant; NaN when R is constant or there is no action token. (Boolean indexing: one sync.)"""
    if validate:
        _check_turn_ids(turn_ids)
        for name, x in (("values", values), ("returns", returns)):
            _check_tensor(name, x, turn_ids)
            _check_float(name, x, turn_ids >= 0)
    act = turn_ids >= 0
    dtype = _compute_dtype(values)
    v, R = values.to(dtype)[act], returns.to(dtype)[act]
    if R.numel() == 0:                                # no action token: undefined
        return torch.full((), math.nan, dtype=dtype, device=values.device)
    var_R = R.var(unbiased=False)                     # NaN when there is no action token
    ev = 1 - (R - v).var(unbiased=False) / var_R
    return torch.where(var_R > 0, ev, torch.full_like(ev, math.nan))   # undefined for constant R


# The paper's Appendix C numbers (§1, §3): 2,048 trajectories over 8 checkpoints, 16,323 turns.
PAPER_TURN_VALUE_STRUCTURE = {
    "between_share_token_median": 0.895, "between_share_equal_median": 0.902,
    "between_exceeds_within_frac": 0.938, "boundary_share_sq_changes": 0.092,
    "boundary_jump_exceeds_span_frac": 0.224, "n_trajectories": 2048, "n_turns": 16323,
}


def turn_value_structure(values, turn_ids) -> dict[str, float]:
    """The paper's Appendix C statistics: do the critic's values vary mainly between turns?

    Rows: a trajectory (row) enters every statistic iff it has at least two turns and its values
    at action tokens are not all equal; rows with one turn (no boundary, no between-turn
    variance) and constant rows (every share 0/0) are left out of all five, and counted in
    n_single_turn and n_constant. Only action tokens are read (observations and padding
    skipped). For a row, v̄ is the mean of its values, m_t and L_t the mean and token count of
    turn t, v_{t,i} its values in order:

      between_share_token_median   median over rows of Σ_t L_t (m_t − v̄)² / Σ_{t,i} (v_{t,i} − v̄)²:
                                   the share of the token-weighted value variance explained by
                                   turn means (paper: 89.5%);
      between_share_equal_median   median of Var_t(m_t) / (Var_t(m_t) + mean_t Var_i(v_{t,i})),
                                   every turn weighted equally, population variances (paper: 90.2%);
      between_exceeds_within_frac  share of rows with Σ_t L_t (m_t − v̄)² > Σ_{t,i} (v_{t,i} − m_t)²
                                   (paper: 93.8%);
      boundary_share_sq_changes    adjacent pairs are consecutive action tokens of a row; a pair
                                   crosses a boundary when its tokens are in different turns (the
                                   last token of turn t, the first of t + 1, observations between
                                   them skipped). Pooled over the rows: Σ Δv² over crossing pairs /
                                   Σ Δv² over all pairs (paper: 9.2%);
      boundary_jump_exceeds_span_frac  share of rows whose jump, the mean |Δv| over its crossing
                                   pairs, exceeds its span, the mean over its turns of the turn's
                                   P95 − P05 (torch.quantile, linear interpolation; 0 for a one-
                                   token turn) (paper: 22.4%);
      n_trajectories, n_turns      the rows used and their turns; n_single_turn, n_constant the
                                   rows left out (rows without any turn are not counted).
    Medians are the usual median (mean of the two middle values for an even count); a statistic
    over no row is NaN.

    Pooling: `values` and `turn_ids` may be lists of batches (pairs of (B_j, T_j) tensors, e.g.
    several rollout batches or checkpoints, as the paper pools 2,048 trajectories over 8
    checkpoints); every statistic is then computed over all their rows together, which is not
    the mean of per-batch statistics. A diagnostic: it loops over rows on the CPU in float64;
    call it every N steps, not every step. The paper's numbers: `PAPER_TURN_VALUE_STRUCTURE`.
    """
    pooled = isinstance(values, (list, tuple)), isinstance(turn_ids, (list, tuple))
    if pooled[0] != pooled[1] or (pooled[0] and len(values) != len(turn_ids)):
        raise ValueError("values and turn_ids must both be tensors, or both lists of as many "
                         "batches")
    batches = list(zip(values, turn_ids)) if pooled[0] else [(values, turn_ids)]
    rows = []
    for V, ids in batches:
        _check_turn_ids(ids)
        _check_tensor("values", V, ids)
        _check_float("values", V, ids >= 0)
        V, ids = V.detach().to("cpu", torch.float64), ids.detach().cpu()
        rows += [(V[b][ids[b] >= 0], ids[b][ids[b] >= 0]) for b in range(V.shape[0])]
    share_tok, share_eq, exceeds, jump_exceeds = [], [], [], []
    sq_boundary = sq_all = 0.0
    n_turns = n_single = n_constant = 0
    for v, t in rows:                                                          # action tokens only
        K = int(t.max()) + 1 if t.numel() else 0
        if K == 1:
            n_single += 1
        if K < 2:
            continue
        if bool((v == v[0]).all()):
            n_constant += 1
            continue
        n_turns += K
        dv = v[1:] - v[:-1]
        crossing = t[1:] != t[:-1]                                             # K - 1 boundary pairs
        sq_all += float((dv ** 2).sum())
        sq_boundary += float((dv[crossing] ** 2).sum())
        turns = [v[t == k] for k in range(K)]
        L = torch.tensor([float(x.numel()) for x in turns], dtype=torch.float64)
        m = torch.stack([x.mean() for x in turns])                             # (K,) turn means
        between = float((L * (m - v.mean()) ** 2).sum())
        within = float(sum(((x - x.mean()) ** 2).sum() for x in turns))
        share_tok.append(between / (between + within))
        var_between_eq = float(m.var(unbiased=False))
        var_within_eq = float(torch.stack([x.var(unbiased=False) for x in turns]).mean())
        share_eq.append(var_between_eq / (var_between_eq + var_within_eq))
        exceeds.append(between > within)
        span = torch.stack([x.quantile(0.95) - x.quantile(0.05) for x in turns]).mean()
        jump_exceeds.append(float(dv[crossing].abs().mean()) > float(span))

    def median(xs):                 # the usual median: the mean of the two middle values if even
        xs = sorted(xs)
        return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else math.nan

    def frac(xs):
        return sum(xs) / len(xs) if xs else math.nan

    return {
        "between_share_token_median": median(share_tok),
        "between_share_equal_median": median(share_eq),
        "between_exceeds_within_frac": frac(exceeds),
        "boundary_share_sq_changes": sq_boundary / sq_all if sq_all > 0 else math.nan,
        "boundary_jump_exceeds_span_frac": frac(jump_exceeds),
        "n_trajectories": len(share_tok),
        "n_turns": n_turns,
        "n_single_turn": n_single,
        "n_constant": n_constant,
    }
