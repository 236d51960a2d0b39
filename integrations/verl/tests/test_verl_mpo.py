"""mpo_verl against the real verl 0.9.1 (no mock of verl's maths): registries, the "mpo" trainer
mode, GAE, whitening, loss aggregation, the example config, the guards and the search task.

Run in the verl venv, with the package installed (docs/verl.md):
    HF_HUB_OFFLINE=1 .venv-verl/bin/python -m pytest integrations/verl/tests -q
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
from types import SimpleNamespace

import pytest

verl = pytest.importorskip("verl")
mpo_verl = pytest.importorskip("mpo_verl", reason="pip install -e integrations/verl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import mpo  # noqa: E402  (the repository's mpo.py: the module mpo_verl loaded)
import verl.utils.torch_functional as verl_F  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos, ray_trainer  # noqa: E402
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn  # noqa: E402
from verl.trainer.ppo.utils import need_critic  # noqa: E402
from verl.trainer.ppo.v1 import get_trainer_cls  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

HERE = Path(__file__).resolve().parent
VERL_DIR = HERE.parent                       # integrations/verl
REPO = VERL_DIR.parents[1]

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


DEFAULTS = {"lam": 0.8, "lam_intra": 0.95, "beta": 1.0, "whiten": True,   # the paper's §7 setting
            "critic_target": "lambda_return"}


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
@pytest.mark.parametrize("params", [{}, {"lam": 0.6, "lam_intra": 0.9, "beta": 0.5, "whiten": False},
                                    {"beta": 0.5, "critic_target": "mae"}])
def test_registered_estimator_equals_mpo_advantages_at_action_tokens(seed, params):
    mask, rewards, values, _ = verl_batch(seed, kl_terms=True)
    fn = get_adv_estimator_fn("mpo")
    adv, ret = fn(token_level_rewards=rewards, response_mask=mask, values=values, config=algo_config(**params),
                  index=np.array([str(i) for i in range(len(mask))], dtype=object))
    p = {**DEFAULTS, **params}
    turn_ids = mpo.turn_ids_from_mask(mask)
    adv_ref, ret_ref = mpo.mpo_advantages(rewards, values, turn_ids, p["lam"], p["lam_intra"], p["beta"], p["whiten"],
                                          critic_target=p["critic_target"])
    act = mask.bool()
    torch.testing.assert_close(adv[act], adv_ref[act], **F32)
    torch.testing.assert_close(ret[act], ret_ref[act], **F32)
    assert adv.shape == mask.shape and not adv[~act].any() and not ret[~act].any()
    if p["whiten"]:
        assert abs(float(adv[act].mean())) < 1e-5


def test_critic_target_selects_the_returns_and_only_mae_depends_on_beta():
    mask, rewards, values, _ = verl_batch(1)
    fn = get_adv_estimator_fn("mpo")
    act = mask.bool()

    def returns(**node):
        return fn(token_level_rewards=rewards, response_mask=mask, values=values,
                  config=algo_config(**node))[1][act]
    lam_ret = returns(beta=1.0)
    assert torch.equal(lam_ret, returns(beta=0.0))                      # independent of beta
    assert not torch.allclose(lam_ret, returns(beta=1.0, critic_target="mae"))
    assert not torch.allclose(returns(beta=1.0, critic_target="mae"),
                              returns(beta=0.0, critic_target="mae"))


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
    adv_ref, ret_ref = mpo.mpo_advantages(moved, values, mpo.turn_ids_from_mask(mask),
                                          critic_target="lambda_return")
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


def test_estimator_without_values_raises_naming_the_trainer_mode():
    mask, rewards, _, _ = verl_batch(0)
    with pytest.raises(ValueError, match="trainer.v1.trainer_mode=mpo"):   # verl's own call: no values
        get_adv_estimator_fn("mpo")(token_level_rewards=rewards, response_mask=mask, config=algo_config())


def test_estimator_refuses_discounting():
    mask, rewards, values, _ = verl_batch(0)
    cfg = algo_config()
    cfg.gamma = 0.99
    with pytest.raises(ValueError, match="gamma"):
        get_adv_estimator_fn("mpo")(token_level_rewards=rewards, response_mask=mask, values=values, config=cfg)


# --- the "mpo" trainer mode: critic values reach the estimator, verl itself is not patched ------

def test_plugin_entry_point_and_trainer_modes_are_registered_without_patching_verl():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="verl.plugins") if ep.name == "mpo"]
    assert [ep.value for ep in eps] == ["mpo_verl._plugin"]           # pip install -e integrations/verl
    assert get_adv_estimator_fn("mpo") is mpo_verl.compute_mpo_advantage
    assert get_policy_loss_fn("mpo") is mpo_verl.compute_policy_loss_mpo
    from verl.trainer.ppo.v1 import PPOTrainerColocateAsync, PPOTrainerSeparateAsync, PPOTrainerSync
    for mode, base in [("mpo", PPOTrainerSync), ("mpo_colocate_async", PPOTrainerColocateAsync),
                       ("mpo_separate_async", PPOTrainerSeparateAsync)]:
        cls = get_trainer_cls(mode)
        assert issubclass(cls, base) and get_trainer_cls(cls.base_mode) is base
        assert cls._compute_advantage is mpo_verl.MPOAdvantage._compute_advantage
    # verl's own functions are untouched: no monkeypatch anywhere.
    from verl.trainer.ppo.v1 import utils as v1_utils
    assert ray_trainer.compute_advantage.__module__ == "verl.trainer.ppo.ray_trainer"
    assert v1_utils.compute_advantage is ray_trainer.compute_advantage


def test_plugin_that_fails_to_import_says_so_at_error_level(monkeypatch, caplog):
    # verl 0.9.1 swallows an entry point's exception (DEBUG log); _plugin.py logs it as an ERROR.
    import runpy

    monkeypatch.setitem(sys.modules, "mpo_verl", None)                   # `import mpo_verl` fails
    with caplog.at_level("ERROR"), pytest.raises(ImportError):
        runpy.run_path(str(VERL_DIR / "mpo_verl" / "_plugin.py"))
    assert [r.levelname for r in caplog.records if "plugin failed to load" in r.message] == ["ERROR"]


def test_mirrored_verl_method_is_the_one_of_verl_0_9_1():
    # MPOAdvantage._compute_advantage mirrors PPOTrainer._compute_advantage of verl 0.9.1 step
    # by step. If verl changes that method, this fails first: re-read it and update the mirror.
    import hashlib
    import inspect

    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    src = inspect.getsource(PPOTrainer._compute_advantage)
    assert verl.__version__ == "0.9.1"
    assert hashlib.sha256(src.encode()).hexdigest()[:16] == VERL_COMPUTE_ADVANTAGE_SHA


VERL_COMPUTE_ADVANTAGE_SHA = "2a4a2aa4a475b228"       # sha256 of its source, first 16 hex


class FakeTransferQueue:
    """verl's TransferQueue (kv_batch_get / kv_batch_put) as a dict of TensorDicts, in memory."""

    def __init__(self, fields):
        self.fields = fields                                   # TensorDict of nested tensors

    def kv_batch_get(self, keys, partition_id, select_fields):
        return self.fields.select(*[f for f in select_fields if f in self.fields.keys()])

    def kv_batch_put(self, keys, partition_id, fields):
        self.fields.update(fields)
        return SimpleNamespace(keys=keys, partition_id=partition_id)


def agent_loop_fields(trajectories, seed=0):
    """The TransferQueue fields of a batch, built by verl 0.9.1's own agent-loop code.

    trajectories: per row (response_mask list, score). Each row goes through
    `AgentLoopOutput.as_dict()` (the score on the last response token, as rm_scores) and the batch
    through `list_of_dict_to_tensordict` (nested tensors), as AgentLoopWorkerTQ stores them; the
    critic's values are stored per response token, as `_compute_values` writes them.
    """
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, (mask, score) in enumerate(trajectories):
        out = AgentLoopOutput(prompt_ids=[5, 6, 7], response_ids=[9] * len(mask), response_mask=mask,
                              reward_score=score, num_turns=2 * sum(mask) + 1, metrics=AgentLoopMetrics())
        d = out.as_dict()
        rows.append({"uid": f"u{i}", "response_mask": d["response_mask"], "rm_scores": d["rm_scores"],
                     "values": torch.randn(len(mask), generator=g)})
    return list_of_dict_to_tensordict(rows)


def run_mpo_trainer_advantage(monkeypatch, fields, adv_estimator="mpo", num_turns=None, **algo):
    """MPOTrainerSync._compute_advantage on a fake TransferQueue; returns its padded outputs."""
    import transfer_queue as tq

    fake = FakeTransferQueue(fields)
    monkeypatch.setattr(tq, "kv_batch_get", fake.kv_batch_get)
    monkeypatch.setattr(tq, "kv_batch_put", fake.kv_batch_put)
    trainer = mpo_verl.MPOTrainerSync.__new__(mpo_verl.MPOTrainerSync)   # no workers: method only
    cfg = {"adv_estimator": adv_estimator, "gamma": 1.0, "lam": 0.95, "use_kl_in_reward": False,
           "norm_adv_by_std_in_grpo": True, "rollout_correction": None, **algo}
    trainer.config = OmegaConf.create({"algorithm": cfg, "actor_rollout_ref": {"rollout": {"n": 1}}})
    trainer.mpo_num_turns = num_turns
    n = fields.batch_size[0]
    keys = [f"u{i}_0_0" for i in range(n)]                              # verl's KVBatchMeta, minimal
    batch = type("KVBatchMeta", (), {"keys": keys, "partition_id": "train", "__len__": lambda self: n})()
    trainer._compute_advantage(batch, metrics={})
    padded = fake.fields.select("advantages", "returns", "response_mask", "values").to_padded_tensor()
    return padded["advantages"], padded["returns"], padded["response_mask"], padded["values"]


# Rows as verl 0.9.1's tool agent loop writes them: each generation appends a run of 1s, each tool
# response (with the chat template's boundary tokens) a run of 0s; rows have different lengths.
AGENT_LOOP_ROWS = [
    ([1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1], 1.0),   # 3 turns, ends on its answer
    ([1, 1, 1, 1, 1], 0.0),                                     # answered at once
    ([1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0], 1.0),                # cut inside a tool response
    ([1, 0, 0, 1, 0, 0, 1, 0, 1, 1, 1], -1.0),                  # one-token turns
]


def test_mpo_trainer_on_the_agent_loop_layout_matches_mpo_py(monkeypatch):
    fields = agent_loop_fields(AGENT_LOOP_ROWS)
    adv, ret, mask, values = run_mpo_trainer_advantage(monkeypatch, fields, num_turns=4,
                                                       mpo={"lam": 0.7, "beta": 0.5})
    # The reference, built from the raw lists: the score of each row on its last model token
    # (mpo.outcome_rewards), whatever verl did with it.
    T = max(len(m) for m, _ in AGENT_LOOP_ROWS)
    ref_mask = torch.tensor([m + [0] * (T - len(m)) for m, _ in AGENT_LOOP_ROWS])
    assert torch.equal(mask, ref_mask)                                   # right-padded, as stored
    turn_ids = mpo.turn_ids_from_mask(ref_mask)
    assert turn_ids.max().item() == 3                                    # 4 turns in row 3
    rewards = mpo.outcome_rewards(torch.tensor([s for _, s in AGENT_LOOP_ROWS]), turn_ids)
    adv_ref, ret_ref = mpo.mpo_advantages(rewards, values, turn_ids, lam=0.7, lam_intra=0.95, beta=0.5,
                                          critic_target="lambda_return")
    act = ref_mask.bool()
    torch.testing.assert_close(adv[act], adv_ref[act], **F32)
    torch.testing.assert_close(ret[act], ret_ref[act], **F32)
    assert not adv[~act].any() and not ret[~act].any()


def test_turn_bound_below_the_batch_raises(monkeypatch):
    # num_turns is multi_turn.max_assistant_turns; a batch with more runs of 1s breaks the layout
    # the bound relies on, and mpo.py's check (on CPU, in the trainer process) says so.
    with pytest.raises(ValueError, match="num_turns=3 but turn_ids holds 4 turns"):
        run_mpo_trainer_advantage(monkeypatch, agent_loop_fields(AGENT_LOOP_ROWS), num_turns=3)


def test_turn_bound_comes_from_max_assistant_turns():
    rollout = {"multi_turn": {"enable": True, "max_assistant_turns": 6}}
    assert mpo_verl.turn_bound(OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}})) == 6
    rollout["multi_turn"]["max_assistant_turns"] = None
    assert mpo_verl.turn_bound(OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}})) is None
    rollout["multi_turn"]["enable"] = False                              # single-turn agent loop
    assert mpo_verl.turn_bound(OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}})) == 1


def test_mpo_trainer_leaves_other_estimators_to_verl(monkeypatch):
    fields = agent_loop_fields(AGENT_LOOP_ROWS)
    adv, ret, mask, values = run_mpo_trainer_advantage(monkeypatch, fields, adv_estimator="gae")
    rewards = torch.zeros(mask.shape)
    lengths = [len(m) for m, _ in AGENT_LOOP_ROWS]
    rewards[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = torch.tensor([s for _, s in AGENT_LOOP_ROWS])
    adv_v, ret_v = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.95)
    act = mask.bool()
    torch.testing.assert_close(adv[act], adv_v[act], rtol=0, atol=0)
    torch.testing.assert_close(ret[act], ret_v[act], rtol=0, atol=0)


def test_verls_own_compute_advantage_refuses_mpo_naming_the_trainer_mode():
    mask, rewards, values, _ = verl_batch(0)
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask, "values": values},
                               non_tensors={"uid": np.array([str(i) for i in range(len(mask))], dtype=object)})
    with pytest.raises(ValueError, match="trainer.v1.trainer_mode=mpo"):
        ray_trainer.compute_advantage(data, "mpo", config=algo_config())


def test_verl_enables_the_critic_for_mpo_only_with_critic_enable():
    base = {"algorithm": {"adv_estimator": "mpo"}}
    with pytest.warns(UserWarning, match="Disabled critic"):
        assert need_critic(OmegaConf.create({**base, "critic": {"enable": None}})) is False
    assert need_critic(OmegaConf.create({**base, "critic": {"enable": True}})) is True


def test_verl_use_external_modules_still_loads_mpo_verl_without_the_entry_point():
    # The fallback: entry points off (VERL_USE_EXTERNAL_PLUGINS=none), the module named instead.
    code = ("import sys, verl\n"
            "assert 'mpo_verl' in sys.modules, 'not loaded'\n"
            "from verl.trainer.ppo import core_algos\n"
            "from verl.trainer.ppo.v1 import get_trainer_cls\n"
            "assert core_algos.get_policy_loss_fn('mpo').__module__ == 'mpo_verl'\n"
            "assert get_trainer_cls('mpo').__name__ == 'MPOTrainerSync'\n"
            "print('MPO_VERL_LOADED')\n")
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "mpo_verl",
           "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=HERE)
    assert out.returncode == 0 and "MPO_VERL_LOADED" in out.stdout, out.stderr[-3000:]
    env["VERL_USE_EXTERNAL_MODULES"] = ""                                # and neither: not loaded
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=HERE)
    assert out.returncode != 0 and "not loaded" in out.stderr


# --- the guards: options MPO cannot run with, and algorithm.mpo's schema --------------------------

@pytest.mark.parametrize("rs", ["token_k1", "seq_mean_k3,token_k3", " token_k2"])
def test_token_level_rejection_sampling_is_refused_naming_the_option(rs):
    cfg = algo_config()
    cfg.rollout_correction = {"rollout_rs": rs, "rollout_rs_threshold": 2.0}
    mask, rewards, values, _ = verl_batch(0)
    with pytest.raises(ValueError, match=r"algorithm\.rollout_correction\.rollout_rs=.*token_k"):
        get_adv_estimator_fn("mpo")(token_level_rewards=rewards, response_mask=mask, values=values, config=cfg)
    with pytest.raises(ValueError, match="sequence-level"):
        mpo_verl.check_rollout_correction(cfg)


def test_sequence_level_rejection_sampling_is_allowed():
    cfg = algo_config()
    cfg.rollout_correction = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}
    mpo_verl.check_rollout_correction(cfg)                               # no error
    mpo_verl.check_rollout_correction(algo_config())


@pytest.mark.parametrize("node,message", [({"bta": 0.5}, "bta"), ({"lam": 1.5}, r"algorithm\.mpo\.lam"),
                                          ({"beta": -1.0}, r"algorithm\.mpo\.beta"),
                                          ({"critic_target": "td"}, r"algorithm\.mpo\.critic_target")])
def test_algorithm_mpo_rejects_unknown_keys_and_out_of_range_values(node, message):
    mask, rewards, values, _ = verl_batch(0)
    with pytest.raises(ValueError, match=message):
        get_adv_estimator_fn("mpo")(token_level_rewards=rewards, response_mask=mask, values=values,
                                    config=algo_config(**node))


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
    assert metrics["actor/mpo_turn_log_ratio_std"] == pytest.approx(
        float(stats["turn_log_ratio_std"]))
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
    ref, _ = mpo.policy_loss(new, old, adv, mpo.turn_ids_from_mask(mask), dual_clip=3.0)     # token mean
    torch.testing.assert_close(loss, ref * mask.sum(), **F32)                                   # x count
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        with pytest.raises(ValueError, match="token-mean"):
            get_policy_loss_fn("mpo")(old, new, adv, mask.bool(), mode, cfg, None)
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=None)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        get_policy_loss_fn("mpo")(old, new, adv, mask.bool(), "token-mean", cfg, None)


# --- the example config and the search task ---------------------------------------------------------

def compose_example(*overrides):
    """example_search_mpo.yaml composed by Hydra as main_ppo composes it, with overrides."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(VERL_DIR), version_base=None):
        return compose(config_name="example_search_mpo", overrides=list(overrides))


def test_example_config_composes_selects_mpo_and_passes_verl_validation(tiny_model_dir):
    from verl.trainer.ppo.utils import need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    cfg = compose_example(f"actor_rollout_ref.model.path={tiny_model_dir}",
                          "data.train_files=/data/train.parquet", "data.val_files=/data/val.parquet")
    assert cfg.algorithm.adv_estimator == "mpo" and cfg.critic.enable is True
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "mpo"
    assert get_trainer_cls(cfg.trainer.v1.trainer_mode) is mpo_verl.MPOTrainerSync
    assert need_critic(cfg) is True and need_reference_policy(cfg) is False
    validate_config(cfg, use_reference_policy=False, use_critic=True)          # verl's own checks
    mpo_verl.check_config(cfg)                                                 # and MPO's
    algo = omega_conf_to_dataclass(cfg.algorithm)                              # verl's schema route
    assert isinstance(algo, mpo_verl.MPOAlgoConfig) and algo.mpo == mpo_verl.MPOConfig()
    assert (algo.mpo.lam, algo.mpo.lam_intra, algo.mpo.beta) == (0.8, 0.95, 1.0)   # the paper's §7
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.loss_agg_mode == "token-mean" and actor.policy_loss.loss_mode == "mpo"
    assert cfg.actor_rollout_ref.rollout.multi_turn.function_tool_path == str(VERL_DIR / "mpo_verl" / "search_tool.py")
    assert cfg.reward.custom_reward_function.path == "pkg://mpo_verl.search_task"
    assert mpo_verl.turn_bound(cfg) == 6


def test_example_config_has_no_env_interpolation_home_path_or_runtime_env():
    text = (VERL_DIR / "example_search_mpo.yaml").read_text()
    body = "\n".join(line.split("#")[0] for line in text.splitlines())      # settings, not comments
    assert "oc.env" not in body and "~" not in body and "PYTHONPATH" not in body
    cfg = compose_example()
    assert OmegaConf.to_container(cfg.ray_kwargs.ray_init.runtime_env) == {"py_executable": None}  # verl's
    for path in (cfg.data.train_files, cfg.data.val_files):              # not verl's ~/data/... default
        assert Path(path).is_absolute() and Path(path).parent == Path("/data/mpo_search")


@pytest.mark.parametrize("override,message", [
    ("algorithm.gamma=0.99", "algorithm.gamma=1.0"),
    ("critic.enable=false", "critic.enable=true"),
    ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "loss_agg_mode"),
    ("algorithm.adv_estimator=gae", "verl's own trainer_mode"),
    ("algorithm.rollout_correction.rollout_rs=token_k1", "rollout_rs='token_k1'"),
    ("algorithm.mpo.lam_intra=2", r"algorithm\.mpo\.lam_intra"),
])
def test_mpo_trainer_refuses_a_config_it_cannot_run_before_any_worker_starts(override, message):
    cfg = compose_example("data.train_files=/x.parquet", "data.val_files=/y.parquet", override)
    with pytest.raises(ValueError, match=message):
        mpo_verl.MPOTrainerSync(cfg)                                      # check_config, first thing


def test_search_tool_loads_through_verl_and_finds_the_first_hop():
    import asyncio

    from verl.tools.function_tool import load_function_tools_from_path

    from mpo_verl import search_task

    tools = load_function_tools_from_path(mpo_verl.package_file("search_tool.py"))
    assert [t.name for t in tools] == ["search"]
    schema = tools[0].tool_schema.model_dump(exclude_none=True)["function"]
    assert schema["parameters"]["required"] == ["query"]
    train, _ = search_task.splits()
    q = train.questions[0]
    text = asyncio.run(tools[0].call({"query": q.gold_queries[0]}))
    assert text.startswith("<information>Doc 1: " + train.docs[q.gold_doc_ids[0]])


def test_reward_reads_the_last_answer_tag():
    from mpo_verl.search_task import compute_score

    assert compute_score("mpo_search", "<tool_response>x</tool_response><answer>The Quessa Guild</answer>",
                         "Quessa Guild") == 1.0
    assert compute_score("mpo_search", "<answer>Varn</answer> ... <answer>Tessaly</answer>", "Varn") == 0.0
    assert compute_score("mpo_search", "no answer", "Varn") == 0.0


def test_data_preparation_writes_verl_rows_that_rlhf_dataset_loads(tmp_path, tiny_model_dir):
    import pandas as pd

    from mpo_verl import search_task
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


def test_pyproject_pins_are_the_requirements_file_pins():
    import tomllib

    project = tomllib.loads((VERL_DIR / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [r for extra in ("cpu", "test")
                                          for r in project["optional-dependencies"][extra]]
    lines = (VERL_DIR / "requirements-verl.txt").read_text().splitlines()
    required = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert all("==" in r for r in declared)                               # every one pinned
    assert sorted(declared, key=str.lower) == sorted(required, key=str.lower)
    import verl as verl_pkg
    assert f"verl=={verl_pkg.__version__}" in project["dependencies"]
