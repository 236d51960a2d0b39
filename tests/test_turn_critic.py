"""Tests for the turn-boundary critic (issue 41, §12): mpo.turn_start_positions and
mpo.spread_turn_values, what MPO computes from a critic's values at turn starts only, and
train_min's --critic turn (its refusals, its running standardisation, its features, its update,
a tiny run end to end with exact resume)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fault_runner
import mpo
import trainer.critics
import train_min
from helpers import make_cfg, run_main

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def _random_layout(g: torch.Generator, B: int = 5, T: int = 40):
    """Rows of prompt, then turns separated by observations, right-padded: (B, T) turn ids."""
    rows = []
    for _ in range(B):
        tid, k = [-1] * int(torch.randint(1, 4, (1,), generator=g)), 0
        for _ in range(int(torch.randint(0, 4, (1,), generator=g))):
            tid += [k] * int(torch.randint(1, 6, (1,), generator=g))
            tid += [-1] * int(torch.randint(1, 4, (1,), generator=g))
            k += 1
        rows.append((tid + [-1] * T)[:T])
    return torch.tensor(rows)


# --- mpo.py: positions and spread ------------------------------------------------------------

def test_turn_start_positions_on_a_hand_layout():
    tid = torch.tensor([[-1, 0, 0, -1, 1, 1, 1, -1],
                        [-1, -1, 0, 0, 0, -1, -1, -1],
                        [-1, -1, -1, -1, -1, -1, -1, -1]])
    pos, mask = mpo.turn_start_positions(tid)
    assert pos.tolist() == [[1, 4], [2, 0], [0, 0]]
    assert mask.tolist() == [[True, True], [True, False], [False, False]]
    pos3, mask3 = mpo.turn_start_positions(tid, num_turns=3)          # a wider K: padded
    assert pos3.shape == (3, 3) and not mask3[:, 2].any()
    with pytest.raises(ValueError, match="num_turns=1 but turn_ids holds 2 turns"):
        mpo.turn_start_positions(tid, num_turns=1)


def test_spread_turn_values_puts_each_turn_start_value_on_its_tokens():
    tid = torch.tensor([[-1, 0, 0, -1, 1, 1, 1, -1], [-1, -1, 0, 0, 0, -1, -1, -1]])
    v = mpo.spread_turn_values(torch.tensor([[1.0, 2.0], [3.0, 9.0]]), tid)
    assert v.tolist() == [[0, 1, 1, 0, 2, 2, 2, 0], [0, 0, 3, 3, 3, 0, 0, 0]]
    with pytest.raises(ValueError, match=r"values_turn must have shape \(2, >= 2\)"):
        mpo.spread_turn_values(torch.zeros(2, 1), tid)
    with pytest.raises(TypeError, match="values_turn must be a floating-point"):
        mpo.spread_turn_values(torch.zeros(2, 2, dtype=torch.long), tid)
    with pytest.raises(ValueError, match="values_turn holds NaN"):
        mpo.spread_turn_values(torch.tensor([[1.0, float("nan")], [0.0, 0.0]]), tid)


@pytest.mark.parametrize("seed", range(4))
def test_with_turn_start_values_mpo_is_turn_gae_of_those_values(seed):
    """What the docstring of spread_turn_values says MPO computes: δ_{t,i} = 0 inside a turn and
    δ^turn_t on its last token; at β = 0 every token of turn t gets A^turn_t = Σ_k λ^k δ^turn_{t+k}
    with δ^turn_t = r_t + V_{t+1,1} − V_{t,1} (by a plain loop here); the "mae" returns at β = 0
    are V_{t,1} + A^turn_t; and β > 0 adds a correction that depends on the position alone."""
    g = torch.Generator().manual_seed(seed)
    tid = _random_layout(g)
    K = int(tid.max()) + 1
    v_turn = torch.randn(tid.shape[0], max(K, 1), generator=g, dtype=torch.float64)
    scores = torch.randn(tid.shape[0], generator=g, dtype=torch.float64)
    values = mpo.spread_turn_values(v_turn, tid)
    rewards = mpo.outcome_rewards(scores, tid)
    lam = 0.8
    delta = mpo.token_td_residuals(rewards, values, tid)
    adv, ret = mpo.mpo_advantages(rewards, values, tid, lam=lam, beta=0.0, whiten=False,
                                  critic_target="mae")
    for b in range(tid.shape[0]):
        n = int(tid[b].max()) + 1
        d_turn = [(scores[b] if t == n - 1 else 0.0) + (v_turn[b, t + 1] if t + 1 < n else 0.0)
                  - v_turn[b, t] for t in range(n)]
        a_turn, acc = [0.0] * n, 0.0
        for t in reversed(range(n)):
            acc = d_turn[t] + lam * acc
            a_turn[t] = acc
        for t in range(n):
            where = (tid[b] == t).nonzero()[:, 0]
            assert not delta[b, where[:-1]].any()                    # 0 inside the turn
            assert torch.isclose(delta[b, where[-1]], torch.as_tensor(d_turn[t], dtype=delta.dtype))
            assert torch.allclose(adv[b, where], torch.full((len(where),), float(a_turn[t]),
                                                            dtype=adv.dtype))
            assert torch.allclose(ret[b, where], v_turn[b, t] + a_turn[t])
    # β > 0: the centred correction β (λ_intra^(L_t − i) − mean) δ^turn_t, position only
    adv1, _ = mpo.mpo_advantages(rewards, values, tid, lam=lam, lam_intra=0.95, beta=1.0,
                                 whiten=False)
    act = tid >= 0
    for b in range(tid.shape[0]):
        for t in range(int(tid[b].max()) + 1):
            where = (tid[b] == t).nonzero()[:, 0]
            L = len(where)
            profile = torch.tensor([0.95 ** (L - 1 - i) for i in range(L)], dtype=torch.float64)
            corr = (profile - profile.mean()) * delta[b, where[-1]]
            assert torch.allclose(adv1[b, where] - adv[b, where], corr)
    assert torch.equal(adv1[~act], adv[~act])


# --- train_min: flags ------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--variant", "grpo"], "--variant grpo has no critic"),
    (["--variant", "ppo"], "--variant ppo's token GAE needs one at every token"),
    (["--variant", "sao"], "--variant sao's token GAE needs one at every token"),
    (["--variant", "mpo"], "--critic turn with --beta 1.0"),
    (["--variant", "mpo_token_is", "--beta", "0.5"], "--critic turn with --beta 0.5"),
    (["--variant", "mpo_beta0", "--critic_layer", "-1"], "--critic_layer must be >= 0"),
])
def test_turn_critic_refuses_what_it_cannot_serve(argv, message, tmp_path):
    with pytest.raises(train_min.ConfigError, match=message):
        train_min.parse_config(["--preset", "tiny", "--critic", "turn", "--out_dir",
                                str(tmp_path), *argv])
    with pytest.raises(SystemExit, match="train_min.py: .*" + message):   # one line, no traceback
        train_min.main(["--preset", "tiny", "--critic", "turn", "--out_dir", str(tmp_path / "x"),
                        *argv])
    assert not (tmp_path / "x").exists()                    # refused before any file is written


def test_turn_critic_accepts_mpo_with_beta_zero_and_an_unknown_critic_is_named(tmp_path):
    for argv in (["--variant", "mpo_beta0"], ["--variant", "mpo", "--beta", "0"],
                 ["--variant", "mpo_token_is", "--beta", "0"]):
        cfg = train_min.parse_config(["--preset", "tiny", "--critic", "turn", "--out_dir",
                                      str(tmp_path), *argv])
        assert cfg.critic == "turn" and cfg.beta == 0
    with pytest.raises(ValueError, match=r"--critic must be one of \('token', 'turn', 'oracle_key', "
                                         r"'oracle_boundary'\), got 'x'"):
        train_min.parse_config(["--preset", "tiny", "--critic", "x", "--out_dir", str(tmp_path)])


# --- train_min: the head ---------------------------------------------------------------------

def test_running_standardisation_equals_the_statistics_of_everything_seen():
    g = torch.Generator().manual_seed(0)
    head = train_min.TurnValueHead(6, layer=1)
    parts = [torch.randn(n, 6, generator=g) * 3 + 5 for n in (7, 1, 0, 12)]
    for x in parts:
        head.stats.observe(x)
    allx = torch.cat(parts).double()
    assert int(head.stats.count) == len(allx)
    assert torch.allclose(head.stats.mean, allx.mean(0))
    assert torch.allclose(head.stats.m2 / head.stats.count, allx.var(0, unbiased=False))
    assert torch.allclose(head.stats.standardise(allx).std(0, unbiased=False),
                          torch.ones(6, dtype=torch.float64))
    assert head(torch.randn(3, 4, 6)).shape == (3, 4)
    assert torch.equal(head(torch.randn(5, 6)), torch.zeros(5))          # V = 0 before a refit
    assert not any(p.requires_grad for p in head.parameters())           # closed form only
    assert {"stats.count", "stats.mean", "stats.m2", "seen_x", "seen_g", "n_seen", "lam",
            "linear.weight", "linear.bias"} == set(head.state_dict())    # kept in checkpoints


def fit(zz, yy, lam):
    """Ridge with a free intercept by a direct solve (3 features): the reference for ridge_loo."""
    X = torch.cat([torch.ones(len(zz), 1, dtype=zz.dtype), zz], 1)
    return torch.linalg.solve(X.T @ X + torch.diag(torch.tensor([0.0, lam, lam, lam],
                                                                dtype=zz.dtype)), X.T @ yy)


def test_ridge_leave_one_out_matches_refitting_without_each_row():
    """trainer.critics.ridge_loo's e_i / (1 − H_ii) is the error of a fit without row i (checked by
    refitting n times), its λ the grid's minimiser of that error, its intercept unpenalised."""
    import trainer.critics
    g = torch.Generator().manual_seed(2)
    z = torch.randn(12, 3, generator=g, dtype=torch.float64)
    y = z @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 4 + \
        0.3 * torch.randn(12, generator=g, dtype=torch.float64)

    def brute_loo(lam):
        err = 0.0
        for i in range(len(y)):
            keep = torch.arange(len(y)) != i
            c = fit(z[keep], y[keep], lam)
            err += float((y[i] - c[0] - z[i] @ c[1:]) ** 2)
        return err / len(y)
    grid = (0.01, 1.0, 30.0, 1e4)
    coef, lam = trainer.critics.ridge_loo(z, y, grid)
    assert lam == min(grid, key=brute_loo)
    assert torch.allclose(coef, fit(z, y, lam))
    big, _ = trainer.critics.ridge_loo(z, y, (1e9,))                             # all shrinkage:
    assert big[1:].abs().max() < 1e-6 and float(big[0]) == pytest.approx(float(y.mean()))


def test_ridge_leave_one_group_out_matches_refitting_without_each_group():
    """With groups, trainer.critics.ridge_loo's (I − H_gg)⁻¹ e_g is the error of a fit without group g
    (checked by refitting once per group), and λ is the grid's minimiser of that error. Rows
    repeated within a group (a question's identical first turn starts) make the two differ."""
    import trainer.critics
    g = torch.Generator().manual_seed(3)
    z = torch.randn(6, 3, generator=g, dtype=torch.float64).repeat_interleave(3, 0)   # (18, 3)
    y = z @ torch.tensor([0.5, -1.0, 0.2], dtype=torch.float64) + \
        torch.randn(18, generator=g, dtype=torch.float64)               # 3 draws per state
    groups = torch.arange(6).repeat_interleave(3)

    def brute(lam):
        err = 0.0
        for q in range(6):
            keep = groups != q
            c = fit(z[keep], y[keep], lam)
            err += float(((y[~keep] - c[0] - z[~keep] @ c[1:]) ** 2).sum())
        return err / len(y)
    grid = (1e-3, 0.3, 3.0, 30.0, 1e4)
    coef, lam = trainer.critics.ridge_loo(z, y, grid, groups=groups)
    assert lam == min(grid, key=brute) and torch.allclose(coef, fit(z, y, lam))
    _, lam_rows = trainer.critics.ridge_loo(z, y, grid)             # one row out: its copies stay in
    assert lam_rows < lam


def test_turn_value_head_by_question_keeps_question_ids_and_refuses_a_mismatch():
    g = torch.Generator().manual_seed(4)
    x, R = torch.randn(24, 5, generator=g), torch.randn(24, generator=g)
    q = torch.arange(8).repeat_interleave(3)
    head = train_min.TurnValueHead(5, layer=1, capacity=16, cv="question")
    assert set(head.state_dict()) == {"stats.count", "stats.mean", "stats.m2", "seen_x", "seen_g",
                                      "seen_q", "n_seen", "lam", "linear.weight", "linear.bias"}
    head.stats.observe(x)
    lam = head.refit(x, R, q)                                # 24 rows into 16 places: the last
    assert torch.equal(head.seen_q, q[-16:]) and torch.equal(head.seen_g, R[-16:])
    import trainer.critics
    coef, lam2 = trainer.critics.ridge_loo(head.stats.standardise(x[-16:]), R[-16:].double(),
                                     groups=q[-16:])
    assert lam == lam2 and torch.allclose(head.linear.weight[0].double(), coef[1:], atol=1e-6)
    with pytest.raises(ValueError, match="question ids"):
        head.refit(x, R)
    with pytest.raises(ValueError, match="question ids"):
        train_min.TurnValueHead(5, layer=1).refit(x, R, q)
    with pytest.raises(ValueError, match="cv must be"):
        train_min.TurnValueHead(5, layer=1, cv="episode")


def test_refit_learns_a_linear_outcome_and_keeps_the_last_capacity_turns():
    g = torch.Generator().manual_seed(1)
    H, scale = 16, torch.logspace(-2, 2, 16)
    w = torch.randn(H, generator=g)

    def draw(n):
        z = torch.randn(n, H, generator=g)
        return z * scale + 10, z @ w + 0.1 * torch.randn(n, generator=g)
    head = train_min.TurnValueHead(H, layer=1, capacity=100)
    for _ in range(6):                                    # 6 batches of 32: the buffer wraps
        x, R = draw(32)
        head.stats.observe(x)
        lam = head.refit(x, R)
    assert int(head.n_seen) == 192 and float(head.lam) == lam
    x, R = draw(2000)
    with torch.no_grad():
        assert 1 - float((R - head(x)).var() / R.var()) > 0.95
    # the fit reads exactly the last 100 rows: a head given only those agrees
    rows_x, rows_g = head.seen_x.clone(), head.seen_g.clone()
    other = train_min.TurnValueHead(H, layer=1, capacity=100)
    other.stats.load_state_dict(head.stats.state_dict())
    other.refit(rows_x, rows_g)
    assert torch.allclose(other.linear.weight, head.linear.weight, atol=1e-6)


# --- train_min: on the tiny model ------------------------------------------------------------

def turn_cfg(tiny_path, base, *extra):         # base, tiny_path: tests/conftest.py
    return make_cfg(tiny_path, base, "--variant", "mpo_beta0", "--critic", "turn", *extra)


def test_turn_features_are_the_frozen_layer_before_each_turn(tiny_path, base):
    """turn_features = the frozen model's hidden_states[layer] at the token before each turn
    start (what the offline probe fits), whatever the policy adapter holds."""
    from helpers import randomise_lora_b
    cfg = turn_cfg(tiny_path, base)
    tok, model, head = train_min.load_model(cfg, CPU)
    assert isinstance(head, train_min.TurnValueHead) and list(model.peft_config) == ["policy"]
    n_layers = model.config.num_hidden_layers
    assert head.layer == n_layers // 2 + 1
    randomise_lora_b(model, 0.5, seed=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tok), (2, 24), generator=g)
    attn = torch.ones_like(ids)
    tid = torch.full((2, 24), -1)
    tid[0, 5:9], tid[0, 12:20], tid[1, 3:10] = 0, 1, 0
    x, below = train_min.turn_features(model, ids, attn, tid, head.layer, num_turns=3)
    assert x.shape == (2, 3, model.config.hidden_size) and below is None
    with torch.no_grad(), model.disable_adapter():
        hs = model.get_base_model().get_decoder()(input_ids=ids, attention_mask=attn,
                                                  output_hidden_states=True).hidden_states
    ref = hs[head.layer]
    for b, k, p in ((0, 0, 5), (0, 1, 12), (1, 0, 3)):
        assert torch.allclose(x[b, k], ref[b, p - 1], atol=1e-5), (b, k)
    assert not x[1, 1:].any() and not x[0, 2].any()                     # absent turns: 0
    # with upto, frozen_states' layers come from the same pass (or a second one when the
    # critic's layer is above them): the features are unchanged and `below` is hidden_states[upto]
    for layer, upto in ((head.layer, head.layer), (head.layer, 1), (1, n_layers)):
        alone = train_min.turn_features(model, ids, attn, tid, layer, 3)[0]
        x2, below = train_min.turn_features(model, ids, attn, tid, layer, 3, upto=upto)
        assert torch.equal(x2, alone) and below.shape == (2, 24, model.config.hidden_size)
        assert torch.allclose(below, hs[upto], atol=1e-5), (layer, upto)
    train_min.use_adapter(model, "policy")
    with torch.no_grad():                                 # the policy's own states differ there
        hp = model.get_base_model().get_decoder()(input_ids=ids, attention_mask=attn,
                                                  output_hidden_states=True).hidden_states
    assert not torch.allclose(hp[-1], hs[-1])
    with pytest.raises(train_min.ConfigError, match=f"--critic_layer must be in 1..{n_layers}"):
        train_min.load_model(turn_cfg(tiny_path, base, "--critic_layer", str(n_layers + 1)), CPU)


def test_score_batch_takes_the_frozen_layers_and_the_turn_features_from_one_pass(tiny_path,
                                                                                   base):
    """With --lora_layers, score_batch's frozen states (reused by every epoch) and the turn
    critic's features come from one pass: both equal what their separate passes give."""
    cfg = turn_cfg(tiny_path, base, "--lora_layers", "1", "--critic_layer", "1")
    tok, model, head = train_min.load_model(cfg, CPU)
    assert train_min.first_adapted_layer(model) == 1
    torch.manual_seed(0)
    suite = train_min.make_suite(cfg)
    batch = train_min.collate(train_min.rollout(model, tok, suite, suite.train[:2], cfg, 2),
                              tok.pad_token_id, CPU)
    train_min.score_batch(model, head, batch, cfg)
    K = int(batch["turn_ids"].max()) + 1
    for micro in (m for mb in batch["plan"] for m in mb):
        ids, attn, tid, _ = train_min.micro_inputs(batch, micro)
        assert torch.equal(batch["frozen"][micro, :ids.shape[1]],
                           train_min.frozen_states(model, ids, attn))
        assert torch.equal(batch["turn_x"][micro],
                           train_min.turn_features(model, ids, attn, tid, 1, K)[0])


def test_a_turn_critic_update_refits_the_head_on_turn_start_targets(tiny_path, base):
    """score_batch gives every token its turn's start value; update refits the head in closed
    form on V_{t,1} + A^turn_t at the batch's turn starts (logging the error before the refit)
    and takes no gradient step for it; the policy adapter is left alone on a critic-only step."""
    cfg = turn_cfg(tiny_path, base, "--critic_warmup_steps", "1")
    tok, model, head = train_min.load_model(cfg, CPU)
    torch.manual_seed(0)
    suite = train_min.make_suite(cfg)
    trajs = train_min.rollout(model, tok, suite, suite.train[:2], cfg, 4)
    batch = train_min.collate(trajs, tok.pad_token_id, CPU)
    batch["scores"] = torch.arange(len(trajs), dtype=torch.float32) % 2      # a spread of R
    train_min.score_batch(model, head, batch, cfg)
    tid = batch["turn_ids"]
    K = int(tid.max()) + 1
    assert batch["turn_x"].shape == (len(trajs), K, model.config.hidden_size)
    pos, mask = mpo.turn_start_positions(tid, K)
    assert int(head.stats.count) == int(mask.sum())                  # observed once per batch
    assert not batch["values"].any()                                 # V = 0 before a refit
    train_min.compute_advantages(batch, cfg)
    expected = mpo.mpo_advantages(mpo.outcome_rewards(batch["scores"], tid), batch["values"],
                                  tid, lam=cfg.lam, beta=0.0, critic_target="mae")[1]
    assert torch.equal(batch["returns"], expected)                   # V_{t,1} + A^turn_t
    policy = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    opt = train_min.make_optimizer(model, head, cfg)
    assert len(opt.param_groups) == 1                                # the policy's only
    batch["step"] = 0                                                # a critic-only step
    stats = train_min.update(model, head, opt, batch, cfg)
    G = batch["returns"].gather(1, pos)[mask]
    assert stats["value_loss"] == pytest.approx(float(0.5 * (G ** 2).mean()))   # V was 0
    assert stats["critic_lambda"] in trainer.critics.RIDGE_LAMBDAS and "critic_grad_norm" not in stats
    assert int(head.n_seen) == len(G)
    coef, lam = trainer.critics.ridge_loo(head.stats.standardise(batch["turn_x"][mask]), G.double())
    assert lam == stats["critic_lambda"]
    assert torch.allclose(head.linear.weight[0].double(), coef[1:].float().double(), atol=1e-6)
    assert float(head.linear.bias) == pytest.approx(float(coef[0]))
    with torch.no_grad():                         # the values the next batch will be scored with
        v = head(batch["turn_x"][mask]).double()
    assert torch.allclose(v, coef[0] + head.stats.standardise(batch["turn_x"][mask]) @ coef[1:],
                          atol=1e-5)
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert torch.equal(p.detach(), policy[n]), n


def test_tiny_run_with_a_turn_critic_checkpoints_the_head_and_resumes_exactly(base, tiny_path):
    from safetensors.torch import load_file
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPO_CACHE", str(base / "mpo-cache"))
        mp.setattr(*fault_runner.quick_build_patch())
        mp.setattr(*fault_runner.parity_reward_patch())
        args = ["--preset", "tiny", "--variant", "mpo_beta0", "--critic", "turn",
                "--eval_every", "2", "--structure_every", "1"]
        split, whole = base / "split", base / "whole"
        run_main(args + ["--steps", "2", "--out_dir", str(split)])
        run_main(args + ["--steps", "4", "--resume", "--out_dir", str(split)])
        run_main(args + ["--steps", "4", "--out_dir", str(whole)])
    rows = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
            for d in (split, whole)]
    assert [r["step"] for r in rows[1]] == [1, 2, 3, 4]
    volatile = ("time/", "tokens_per_s", "mem/")
    for a, b in zip(*rows):
        assert ({k: v for k, v in a.items() if not k.startswith(volatile)}
                == {k: v for k, v in b.items() if not k.startswith(volatile)})
    assert any(r["loss/value_loss"] > 0 for r in rows[1])
    # a turn critic's values are constant within turns: all their variance lies between turns
    shares = [r["critic/between_share_token_median"] for r in rows[1]
              if r.get("critic/n_trajectories", 0) > 0]
    assert all(s == pytest.approx(1.0) for s in shares)
    ck = whole / "checkpoints" / "step_000004"
    assert not (ck / "adapters" / "critic").exists()
    head = load_file(ck / "value_head.safetensors")
    assert {"stats.count", "seen_x", "n_seen", "lam", "linear.weight"} <= set(head)
    assert head["stats.count"] > 0 and head["n_seen"] > 0
    assert head["linear.weight"].abs().max() > 0
    sa = load_file(split / "checkpoints" / "step_000004" / "value_head.safetensors")
    assert all(torch.equal(sa[k], head[k]) for k in head)


def test_both_critics_are_one_interface_and_only_the_token_critic_trains_by_gradient(tiny_path,
                                                                                      base):
    """Issue 52: train_min holds its critic without asking which: ValueHead (the token critic)
    and TurnValueHead (--critic turn) answer the same calls; what differs is in the answers."""
    calls = ("begin", "features", "values", "finish", "param_groups", "epochs", "after_update")
    token, turn = train_min.ValueHead(8), trainer.critics.TurnValueHead(8, layer=1)
    for head in (token, turn):
        assert all(callable(getattr(head, name)) for name in calls), type(head).__name__
    assert (token.kind, turn.kind) == ("token", "turn")
    mpo_cfg = make_cfg(tiny_path, base, "--variant", "mpo", "--ppo_epochs", "3")
    grpo_cfg = make_cfg(tiny_path, base, "--variant", "grpo")
    named = [("x.critic.lora_A", torch.nn.Parameter(torch.zeros(1))),
             ("x.policy.lora_A", torch.nn.Parameter(torch.zeros(1)))]
    groups = token.param_groups(named, mpo_cfg)
    assert [len(g["params"]) for g in groups] == [1, 2]            # the adapter; weight and bias
    assert [g["lr"] for g in groups] == [mpo_cfg.lr_critic, mpo_cfg.lr_value_head]
    assert token.param_groups(named, grpo_cfg) == [] and token.epochs(grpo_cfg) == 0
    assert token.epochs(mpo_cfg) == 3 and token.values(None, None, None, None, grpo_cfg) is None
    assert turn.param_groups(named, mpo_cfg) == [] and turn.epochs(mpo_cfg) == 0
    assert token.after_update({}) == {}


def test_a_turn_critic_reads_a_bfloat16_model_s_states_in_float32(base, tmp_path):
    """--dtype bfloat16 (auto on a CPU with bf16 units, as SmolLM2's demo on AVX-512 BF16 cores):
    the frozen layer's states are bf16, the head's buffer float32; one step runs and refits."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPO_CACHE", str(base / "mpo-cache"))
        mp.setattr(*fault_runner.quick_build_patch())
        mp.setattr(*fault_runner.parity_reward_patch())
        run_main(["--preset", "tiny", "--variant", "mpo_beta0", "--critic", "turn", "--dtype",
                  "bfloat16", "--steps", "1", "--eval_every", "1", "--out_dir", str(tmp_path / "b")])
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss/critic_lambda"] > 0 for r in rows if "loss/critic_lambda" in r] == [True]
