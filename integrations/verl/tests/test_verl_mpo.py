"""mpo_verl against the real verl 0.9.1 (no mock of verl): registries, hook, GAE, whitening, loss
aggregation, the example config and the search task.

Run in the verl venv (docs/verl.md):
    cd /work/main && HF_HUB_OFFLINE=1 /work/verl-venv/bin/python -m pytest integrations/verl/tests -q
Collected without verl (the main venv), the whole file skips.

Batches are verl-shaped: `response_mask` right-padded, several runs of 1s (assistant turns)
separated by runs of 0s (tool responses), the outcome score on the last valid response token
(as verl's agent loop writes `rm_scores`), critic values at every position.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

verl = pytest.importorskip("verl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

HERE = Path(__file__).resolve().parent
VERL_DIR = HERE.parent                       # integrations/verl
REPO = VERL_DIR.parents[1]
sys.path.insert(0, str(VERL_DIR))

import mpo_verl  # noqa: E402  (puts the repo root, where mpo.py is, on sys.path)
import mpo  # noqa: E402  isort: skip
import verl.utils.torch_functional as verl_F  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos, ray_trainer  # noqa: E402
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn  # noqa: E402
from verl.trainer.ppo.utils import need_critic  # noqa: E402
from verl.trainer.ppo.v1 import utils as v1_utils  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

F32 = dict(rtol=1e-5, atol=1e-5)             # float32 comparisons
# verl's masked_var computes its Bessel factor n / (n - 1) from integer mask sums, which torch
# divides in float32 whatever the data's dtype: float64 whitening agrees to ~6e-8 relative only.
F64_WHITENED = dict(rtol=2e-7, atol=2e-7)


# --- verl-shaped batches ------------------------------------------------------------------------

def verl_batch(seed: int, B: int = 6, T: int = 112, end_in_tool: bool = False, kl_terms: bool = False,
               dtype=torch.float32):
    """(response_mask int64, token_level_rewards, values, last_valid) like verl's agent loop output.

    Row b: turns of 1-12 model tokens separated by 1-8 tool tokens, then right padding. With
    `end_in_tool`, even rows end inside a tool response (cut at response_length), so their score
    sits on a tool token. `kl_terms` adds small per-token rewards on model tokens
    (algorithm.use_kl_in_reward).
    """
    g = torch.Generator().manual_seed(seed)

    def r(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    mask = torch.zeros(B, T, dtype=torch.int64)
    last_valid = []
    for b in range(B):
        p, n_turns = 0, r(1, 5)
        for k in range(n_turns):
            L = r(1, 12)
            mask[b, p:p + L] = 1
            p += L
            if k < n_turns - 1 or (end_in_tool and b % 2 == 0):
                p += r(1, 8)                                       # tool response: zeros
        last_valid.append(p - 1)
    rewards = torch.zeros(B, T, dtype=dtype)
    scores = torch.randn(B, generator=g, dtype=dtype)
    rewards[torch.arange(B), torch.tensor(last_valid)] = scores     # verl: rm_scores[last valid] = score
    if kl_terms:
        rewards += 0.01 * torch.randn(B, T, generator=g, dtype=dtype) * mask
    values = torch.randn(B, T, generator=g, dtype=dtype)           # the critic writes every position
    return mask, rewards, values, last_valid


def algo_config(**mpo_params):
    """verl's `algorithm` config node as the trainer passes it (a DictConfig)."""
    node = {"gamma": 1.0, "lam": 1.0, "adv_estimator": "mpo", "use_pf_ppo": False}
    if mpo_params:
        node["mpo"] = mpo_params
    return OmegaConf.create(node)


def actor_config(**kw):
    return FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **kw)


# --- the "mpo" advantage estimator ----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("params", [{}, {"lam": 0.6, "lam_intra": 0.9, "beta": 0.5, "whiten": False}])
def test_registered_estimator_equals_mpo_advantages_at_action_tokens(seed, params):
    mask, rewards, values, _ = verl_batch(seed, kl_terms=True)
    fn = get_adv_estimator_fn("mpo")
    adv, ret = fn(token_level_rewards=rewards, response_mask=mask, values=values, config=algo_config(**params),
                  index=np.array([str(i) for i in range(len(mask))], dtype=object))
    p = {**mpo_verl.MPO_DEFAULTS, **params}
    turn_ids = mpo.turn_ids_from_mask(mask)
    adv_ref, ret_ref = mpo.mpo_advantages(rewards, values, turn_ids, p["lam"], p["lam_intra"], p["beta"], p["whiten"])
    act = mask.bool()
    torch.testing.assert_close(adv[act], adv_ref[act], **F32)
    torch.testing.assert_close(ret[act], ret_ref[act], **F32)
    assert adv.shape == mask.shape and not adv[~act].any() and not ret[~act].any()
    if p["whiten"]:
        assert abs(float(adv[act].mean())) < 1e-5


def test_score_on_tool_token_moves_to_previous_action_token():
    # turn 0 = positions 0-1, tool 2-3, turn 1 = 4-5, tool 6-7 (cut), padding 8: score on 7.
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0, 0]])
    rewards = torch.zeros(1, 9)
    rewards[0, 7] = 1.0
    moved = mpo_verl.rewards_on_action_tokens(rewards, mask)
    assert moved.tolist() == [[0, 0, 0, 0, 0, 1, 0, 0, 0]]
    values = torch.linspace(0.1, 0.9, 9)[None]
    adv, ret = get_adv_estimator_fn("mpo")(token_level_rewards=rewards, response_mask=mask, values=values,
                                           config=algo_config())
    adv_ref, ret_ref = mpo.mpo_advantages(moved, values, mpo.turn_ids_from_mask(mask))
    torch.testing.assert_close(adv, adv_ref, **F32)
    torch.testing.assert_close(ret, ret_ref, **F32)
    with pytest.raises(ValueError, match="off action positions"):       # what mpo.py alone says
        mpo.mpo_advantages(rewards, values, mpo.turn_ids_from_mask(mask))


@pytest.mark.parametrize("seed", range(3))
def test_reward_relocation_preserves_row_sums_and_leaves_action_rewards(seed):
    mask, rewards, _, last_valid = verl_batch(seed, end_in_tool=True, kl_terms=True)
    moved = mpo_verl.rewards_on_action_tokens(rewards, mask)
    act = mask.bool()
    assert not moved[~act].any()
    torch.testing.assert_close(moved.sum(1), rewards.sum(1), **F32)
    on_tool = [b for b in range(len(mask)) if mask[b, last_valid[b]] == 0]
    assert on_tool, "the batch must exercise a score on a tool token"
    for b in range(len(mask)):
        if b not in on_tool:
            torch.testing.assert_close(moved[b], rewards[b], rtol=0, atol=0)


def test_reward_before_any_action_token_is_dropped():
    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]])
    rewards = torch.tensor([[0.5, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]])
    assert mpo_verl.rewards_on_action_tokens(rewards, mask).tolist() == [[0, 0, 0, 1], [0, 0, 0, 0]]


def test_estimator_without_values_raises_naming_the_critic_switch():
    mask, rewards, _, _ = verl_batch(0)
    with pytest.raises(ValueError, match="critic.enable=True"):           # verl's own call: no values
        get_adv_estimator_fn("mpo")(token_level_rewards=rewards, response_mask=mask, config=algo_config())


def test_estimator_refuses_discounting():
    mask, rewards, values, _ = verl_batch(0)
    cfg = algo_config()
    cfg.gamma = 0.99
    with pytest.raises(ValueError, match="gamma"):
        get_adv_estimator_fn("mpo")(token_level_rewards=rewards, response_mask=mask, values=values, config=cfg)


# --- the hook: critic values reach the estimator in both trainers -------------------------------

def _data_proto(mask, rewards, values=None):
    tensors = {"token_level_rewards": rewards, "response_mask": mask}
    if values is not None:
        tensors["values"] = values
    uids = np.array([f"u{i // 2}" for i in range(len(mask))], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids})


def test_hook_is_installed_where_verl_trainers_call_compute_advantage():
    from verl.experimental.separation import ray_trainer as separation_trainer
    assert ray_trainer.compute_advantage is mpo_verl.compute_advantage          # legacy trainer
    assert v1_utils.compute_advantage is mpo_verl.compute_advantage             # v1 trainer (default)
    assert separation_trainer.compute_advantage is mpo_verl.compute_advantage   # async trainers
    assert mpo_verl.install() == []                                             # idempotent


@pytest.mark.parametrize("seed", range(2))
def test_hook_passes_critic_values_to_mpo_in_legacy_and_v1_trainers(seed):
    mask, rewards, values, _ = verl_batch(seed, end_in_tool=True)
    cfg = algo_config(lam=0.7)
    expected, expected_ret = get_adv_estimator_fn("mpo")(token_level_rewards=rewards, response_mask=mask,
                                                         values=values, config=cfg)
    legacy = ray_trainer.compute_advantage(_data_proto(mask, rewards, values), "mpo", config=cfg)
    v1 = v1_utils.compute_advantage_for_multi_trajectories(
        _data_proto(mask, rewards, values), batch_keys=[f"u{i}_0_0" for i in range(len(mask))],
        adv_estimator="mpo", config=cfg)
    for out in (legacy, v1):
        torch.testing.assert_close(out.batch["advantages"], expected, rtol=0, atol=0)
        torch.testing.assert_close(out.batch["returns"], expected_ret, rtol=0, atol=0)


def test_hook_without_critic_raises():
    mask, rewards, _, _ = verl_batch(0)
    with pytest.raises(ValueError, match="critic.enable=True"):
        ray_trainer.compute_advantage(_data_proto(mask, rewards), "mpo", config=algo_config())


def test_hook_leaves_other_estimators_to_verl():
    mask, rewards, values, _ = verl_batch(1)
    out = ray_trainer.compute_advantage(_data_proto(mask, rewards, values), "gae", gamma=1.0, lam=0.95,
                                        config=algo_config())
    adv, ret = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(out.batch["advantages"], adv, rtol=0, atol=0)
    torch.testing.assert_close(out.batch["returns"], ret, rtol=0, atol=0)


def test_verl_enables_the_critic_for_mpo_only_with_critic_enable():
    base = {"algorithm": {"adv_estimator": "mpo"}}
    with pytest.warns(UserWarning, match="Disabled critic"):
        assert need_critic(OmegaConf.create({**base, "critic": {"enable": None}})) is False
    assert need_critic(OmegaConf.create({**base, "critic": {"enable": True}})) is True


def test_verl_use_external_modules_loads_mpo_verl_in_a_fresh_process():
    code = ("import verl\n"
            "from verl.trainer.ppo import core_algos, ray_trainer\n"
            "from verl.trainer.ppo.v1 import utils\n"
            "import mpo_verl\n"
            "assert core_algos.get_adv_estimator_fn('mpo') is mpo_verl.compute_mpo_advantage\n"
            "assert core_algos.get_policy_loss_fn('mpo') is mpo_verl.compute_policy_loss_mpo\n"
            "assert ray_trainer.compute_advantage is mpo_verl.compute_advantage\n"
            "assert utils.compute_advantage is mpo_verl.compute_advantage\n"
            "print('MPO_VERL_LOADED')\n")
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "mpo_verl", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(VERL_DIR), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "MPO_VERL_LOADED" in out.stdout, out.stderr[-3000:]


# --- verl's GAE and whitening vs mpo.py -----------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (1.0, 0.0)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, F32), (torch.float64, F64_WHITENED)])
def test_verl_gae_equals_mpo_token_gae_at_action_tokens(seed, gamma, lam, dtype, tol):
    # verl 0.9.1 skips tool tokens (nextvalues / lastgaelam pass through mask-0 positions), as
    # mpo.token_gae does: same advantages and returns wherever response_mask is 1.
    mask, rewards, values, _ = verl_batch(seed, kl_terms=True, dtype=dtype)
    adv_v, ret_v = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma=gamma, lam=lam)
    adv_m, ret_m = mpo.token_gae(rewards, values, mask, lam=lam, gamma=gamma)
    act = mask.bool()
    torch.testing.assert_close(adv_v[act], adv_m[act], **tol)
    torch.testing.assert_close(ret_v[act], ret_m[act], **tol)


def test_verl_gae_copies_the_next_action_advantage_onto_tool_tokens():
    # Off the mask the two differ, and nothing reads those positions: verl carries the next
    # action token's advantage through a tool run (whitened alike), mpo.py writes 0.
    mask, rewards, values, _ = verl_batch(5)
    adv_v, _ = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.95)
    adv_m, _ = mpo.token_gae(rewards, values, mask, lam=0.95)
    checked = 0
    for b in range(len(mask)):
        act = mask[b].nonzero().flatten().tolist()
        for p in range(act[0], act[-1]):
            if not mask[b, p]:
                nxt = next(q for q in act if q > p)
                assert float(adv_v[b, p]) == float(adv_v[b, nxt]) and float(adv_m[b, p]) == 0.0
                checked += 1
    assert checked > 0


def test_verl_gae_drops_a_score_that_sits_on_a_tool_token():
    # verl's GAE adds r_t only where response_mask is 1, so a score left on the last valid token
    # of a row that ends inside a tool response is lost; mpo_verl moves it (see above) and
    # mpo.token_gae refuses it.
    mask, rewards, values, last_valid = verl_batch(2, end_in_tool=True)
    on_tool = [b for b in range(len(mask)) if mask[b, last_valid[b]] == 0]
    assert on_tool
    dropped = rewards.clone()
    dropped[on_tool, [last_valid[b] for b in on_tool]] = 0.0
    adv_a, ret_a = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.95)
    adv_b, ret_b = core_algos.compute_gae_advantage_return(dropped, values, mask, gamma=1.0, lam=0.95)
    act = mask.bool()
    torch.testing.assert_close(adv_a[act], adv_b[act], rtol=0, atol=0)
    torch.testing.assert_close(ret_a[act], ret_b[act], rtol=0, atol=0)
    with pytest.raises(ValueError, match="off action positions"):
        mpo.token_gae(rewards, values, mask)


@pytest.mark.parametrize("seed", range(3))
def test_masked_whiten_matches_verl_unbiased_whitening(seed):
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(5, 40, generator=g, dtype=torch.float64) + 1
    mask = torch.rand(5, 40, generator=g) < 0.4
    ours, theirs = mpo.masked_whiten(x, mask), verl_F.masked_whiten(x, mask)
    torch.testing.assert_close(ours[mask], theirs[mask], **F64_WHITENED)   # see F64_WHITENED
    # Same mean and unbiased variance: with verl's float32 Bessel factor made exact, they agree
    # to float64 rounding.
    n = mask.sum().double()
    exact = verl_F.masked_mean(x, mask)
    var = verl_F.masked_var(x, mask, unbiased=False) * n / (n - 1)
    torch.testing.assert_close(ours[mask], ((x - exact) * torch.rsqrt(var + 1e-8))[mask], rtol=1e-12, atol=1e-12)
    assert not ours[~mask].any()                       # verl leaves (x - mean)·s there


# --- the "mpo" policy loss ------------------------------------------------------------------------

def _logps(mask, seed, spread=0.3):
    g = torch.Generator().manual_seed(100 + seed)
    old = -2 * torch.rand(mask.shape, generator=g)
    new = (old + spread * torch.randn(mask.shape, generator=g)).requires_grad_(True)
    adv = torch.randn(mask.shape, generator=g) * mask
    return old, new, adv


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("clip_high,clip_c", [(0.2, 3.0), (0.28, 1.5)])
def test_registered_loss_equals_mpo_policy_loss_and_gradients(seed, clip_high, clip_c):
    mask, _, _, _ = verl_batch(seed)
    old, new, adv = _logps(mask, seed)
    cfg = actor_config(clip_ratio_low=0.2, clip_ratio_high=clip_high, clip_ratio_c=clip_c)
    loss, metrics = get_policy_loss_fn("mpo")(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask.bool(),
                                              loss_agg_mode="token-mean", config=cfg, rollout_is_weights=None)
    (grad,) = torch.autograd.grad(loss, new)
    new_ref = new.detach().clone().requires_grad_(True)
    loss_ref, stats = mpo.policy_loss(new_ref, old, adv, mpo.turn_ids_from_mask(mask), clip_eps=0.2,
                                      ratio_level="turn", clip_eps_high=clip_high, dual_clip=clip_c)
    (grad_ref,) = torch.autograd.grad(loss_ref, new_ref)
    torch.testing.assert_close(loss, loss_ref, **F32)
    torch.testing.assert_close(grad, grad_ref, **F32)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float(stats["clip_frac"]))
    assert metrics["actor/mpo_turn_clipfrac"] == pytest.approx(float(stats["turn_clip_frac"]))
    # Multi-token turns: the turn ratio is really in use (the token-ratio PPO loss differs).
    vanilla, _ = get_policy_loss_fn("vanilla")(old, new, adv, mask.bool(), "token-mean", cfg, None)
    assert abs(vanilla.item() - loss.item()) > 1e-4


@pytest.mark.parametrize("seed", range(3))
def test_loss_with_one_token_turns_equals_verl_vanilla_ppo(seed):
    # ρ̃ = ρ when every turn is one token, so "mpo" must reproduce verl's "vanilla" loss exactly,
    # clip-higher, dual clip and rollout-correction weights included.
    B, T = 6, 40
    mask = torch.zeros(B, T, dtype=torch.int64)
    mask[:, 0:30:2] = 1                                            # 1, 0, 1, 0, ... then padding
    old, new, adv = _logps(mask, seed, spread=1.0)                # wide: clipped and dual-clipped terms
    w = 2 * torch.rand(B, T, generator=torch.Generator().manual_seed(seed))
    cfg = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=2.0)
    out = {}
    for mode in ("mpo", "vanilla"):
        x = new.detach().clone().requires_grad_(True)
        loss, metrics = get_policy_loss_fn(mode)(old_log_prob=old, log_prob=x, advantages=adv,
                                                 response_mask=mask.bool(), loss_agg_mode="token-mean",
                                                 config=cfg, rollout_is_weights=w)
        out[mode] = (loss, torch.autograd.grad(loss, x)[0], metrics)
    torch.testing.assert_close(out["mpo"][0], out["vanilla"][0], **F32)
    torch.testing.assert_close(out["mpo"][1], out["vanilla"][1], **F32)
    assert out["mpo"][2]["actor/ppo_kl"] == pytest.approx(out["vanilla"][2]["actor/ppo_kl"], rel=1e-5)


def test_micro_batches_and_dp_ranks_add_up_to_the_full_batch_gradient():
    # verl's ppo_loss sets global_batch_info per micro-batch: dp_size and the mini-batch's global
    # token count; DP then averages gradients over ranks. 2 ranks x 2 micro-batches of 2 rows.
    mask, _, _, _ = verl_batch(7, B=8)
    old, new, adv = _logps(mask, 7)
    cfg = actor_config()
    n_tokens = int(mask.sum())
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=n_tokens, global_batch_size=8, loss_scale_factor=None)
    loss_fn = get_policy_loss_fn("mpo")
    total = 0.0
    for rank_rows in (range(0, 4), range(4, 8)):
        for mb in (list(rank_rows)[:2], list(rank_rows)[2:]):
            loss_mb, _ = loss_fn(old[mb], new[mb], adv[mb], mask[mb].bool(), "token-mean", cfg, None)
            total = total + loss_mb / 2                                  # DP all-reduce: mean over ranks
    (grad,) = torch.autograd.grad(total, new)
    x = new.detach().clone().requires_grad_(True)
    full, _ = mpo.policy_loss(x, old, adv, mpo.turn_ids_from_mask(mask), clip_eps=0.2, dual_clip=3.0)
    (grad_full,) = torch.autograd.grad(full, x)
    torch.testing.assert_close(total, full, **F32)
    torch.testing.assert_close(grad, grad_full, **F32)
    # The same global count as mpo.py's num_tokens: one micro-batch's loss.
    loss_mb, _ = loss_fn(old[:2], new[:2], adv[:2], mask[:2].bool(), "token-mean", cfg, None)
    ref_mb, _ = mpo.policy_loss(new[:2], old[:2], adv[:2], mpo.turn_ids_from_mask(mask[:2]), dual_clip=3.0,
                                num_tokens=n_tokens)
    torch.testing.assert_close(loss_mb, 2 * ref_mb, **F32)


def test_token_sum_aggregation_and_unsupported_modes():
    mask, _, _, _ = verl_batch(3)
    old, new, adv = _logps(mask, 3)
    cfg = actor_config()
    loss, _ = get_policy_loss_fn("mpo")(old, new, adv, mask.bool(), "token-sum", cfg, None)
    ref, _ = mpo.policy_loss(new, old, adv, mpo.turn_ids_from_mask(mask), dual_clip=3.0, num_tokens=1)
    torch.testing.assert_close(loss, ref, **F32)
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        with pytest.raises(ValueError, match="token-mean"):
            get_policy_loss_fn("mpo")(old, new, adv, mask.bool(), mode, cfg, None)
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=None)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        get_policy_loss_fn("mpo")(old, new, adv, mask.bool(), "token-mean", cfg, None)


# --- the example config and the search task ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A local Qwen2 config + byte-level BPE tokenizer, so verl's HFModelConfig loads offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    d = tmp_path_factory.mktemp("tiny_qwen2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["search the knowledge base for one name"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf_tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                            "<|im_end|>\n{% endfor %}")
    hf_tok.save_pretrained(d)
    Qwen2Config(vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"]).save_pretrained(d)
    return d


def test_example_config_composes_selects_mpo_and_passes_verl_validation(tiny_model_dir, monkeypatch):
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    monkeypatch.setenv("MPO_REPO", str(REPO))
    monkeypatch.setenv("PYTHONPATH", str(VERL_DIR))
    with initialize_config_dir(config_dir=str(VERL_DIR), version_base=None):
        cfg = compose(config_name="example_search_mpo", overrides=[f"actor_rollout_ref.model.path={tiny_model_dir}"])
    assert cfg.algorithm.adv_estimator == "mpo" and cfg.critic.enable is True
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "mpo"
    assert get_adv_estimator_fn(cfg.algorithm.adv_estimator) is mpo_verl.compute_mpo_advantage
    assert get_policy_loss_fn(cfg.actor_rollout_ref.actor.policy_loss.loss_mode) is mpo_verl.compute_policy_loss_mpo
    assert need_critic(cfg) is True and need_reference_policy(cfg) is False
    validate_config(cfg, use_reference_policy=False, use_critic=True)          # verl's own checks
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.loss_agg_mode == "token-mean" and actor.policy_loss.loss_mode == "mpo"
    assert Path(cfg.actor_rollout_ref.rollout.multi_turn.function_tool_path).is_file()
    assert Path(cfg.reward.custom_reward_function.path).is_file()
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES == "mpo_verl"
    p = mpo_verl.MPO_DEFAULTS
    assert dict(cfg.algorithm.mpo) == p and cfg.algorithm.gamma == 1.0


def test_search_tool_loads_through_verl_and_finds_the_first_hop():
    import asyncio

    import search_task
    from verl.tools.function_tool import load_function_tools_from_path

    tools = load_function_tools_from_path(str(VERL_DIR / "search_tool.py"))
    assert [t.name for t in tools] == ["search"]
    schema = tools[0].tool_schema.model_dump(exclude_none=True)["function"]
    assert schema["parameters"]["required"] == ["query"]
    train, _ = search_task.splits()
    q = train.questions[0]
    text = asyncio.run(tools[0].call({"query": q.gold_queries[0]}))
    assert text.startswith("<information>Doc 1: " + train.docs[q.gold_doc_ids[0]])


def test_reward_reads_the_last_answer_tag():
    from search_task import compute_score

    assert compute_score("mpo_search", "<tool_response>x</tool_response><answer>The Quessa Guild</answer>",
                         "Quessa Guild") == 1.0
    assert compute_score("mpo_search", "<answer>Varn</answer> ... <answer>Tessaly</answer>", "Varn") == 0.0
    assert compute_score("mpo_search", "no answer", "Varn") == 0.0


def test_data_preparation_writes_verl_rows_that_rlhf_dataset_loads(tmp_path, tiny_model_dir):
    import pandas as pd
    import search_task
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    train_path, val_path = search_task.write_parquet(tmp_path)
    train = pd.read_parquet(train_path)
    assert len(train) == search_task.N_TRAIN and len(pd.read_parquet(val_path)) == search_task.N_VAL
    row = train.iloc[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["reward_model"]["ground_truth"] and row["data_source"] == search_task.DATA_SOURCE
    data_cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 1024, "return_raw_chat": True,
                                 "truncation": "error", "filter_overlong_prompts": False})
    ds = RLHFDataset(data_files=str(val_path), tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
                     config=data_cfg, processor=None)
    item = ds[0]
    assert len(ds) == search_task.N_VAL and list(item["raw_prompt"])[1]["content"].startswith("Question: ")
