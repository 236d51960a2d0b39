"""The statistics of one update, each pooled by its own denominator over every micro-batch of every
minibatch and epoch (train_min.update), so a logged number means what its name says however the
batch was split for memory:

  - token means (clip_frac, approx_kl, ratio_mean, entropy, SAO's mask fractions): weighted by
    the micro-batch's action tokens, i.e. the share of all action tokens scored in the update;
  - turn means (turn_clip_frac, turn_log_ratio_mean): weighted by the micro-batch's turns, i.e.
    the share of turns (1 of 6 clipped: 1/6, not a token-weighted mean of fractions);
  - maxima (ratio_max): the largest;
  - spreads (turn_log_ratio_std): the sample std over all turns, recomputed exactly from each
    micro-batch's count, mean and std (Σx² = (n − 1) s² + n m²);
  - the losses (policy_loss, value_loss, kl_base; each micro-batch's part of its minibatch's token
    mean) summed within a minibatch, and they and the gradient norms averaged over minibatches.
"""
from __future__ import annotations

import math

import torch

PER_MINIBATCH = ("policy_loss", "value_loss", "kl_base")     # parts of a minibatch's token mean
TURN_MEANS = ("turn_clip_frac", "turn_log_ratio_mean")
MAXIMA = ("ratio_max",)
SPREADS = {"turn_log_ratio_std": "turn_log_ratio_mean"}     # a std over turns -> its turns' mean


def count_turns(turn_ids: torch.Tensor) -> int:
    """Turns in a (m, w) micro-batch: each row's turns are numbered 0, 1, ... (mpo's layout)."""
    return int((turn_ids.amax(dim=1).clamp(min=-1) + 1).sum())


class UpdateStats:
    """Collects `micro(stats, tokens, turns)` per micro-batch and `minibatch(stats)` per optimiser
    step (its gradient norms); `result()` is the update's statistics."""

    def __init__(self):
        self.sums, self.weights, self.maxima = {}, {}, {}
        self.spread = {}                # name -> [turns, Σ x, Σ x²] over the update's turns
        self.part, self.steps = {}, {}  # this minibatch's loss parts; per-minibatch values

    def micro(self, stats: dict, tokens: int, turns: int) -> None:
        for name, value in stats.items():
            value = float(value)
            if name in PER_MINIBATCH:
                self.part[name] = self.part.get(name, 0.0) + value
            elif name in MAXIMA:
                self.maxima[name] = max(self.maxima.get(name, -math.inf), value)
            elif name in SPREADS:
                mean = float(stats[SPREADS[name]])
                acc = self.spread.setdefault(name, [0, 0.0, 0.0])
                acc[0] += turns
                acc[1] += turns * mean
                acc[2] += max(turns - 1, 0) * value ** 2 + turns * mean ** 2
            else:
                weight = turns if name in TURN_MEANS else tokens
                self.sums[name] = self.sums.get(name, 0.0) + value * weight
                self.weights[name] = self.weights.get(name, 0) + weight

    def minibatch(self, stats: dict) -> None:
        """Close a minibatch: its summed loss parts and `stats` (e.g. gradient norms) count once."""
        for name, value in {**self.part, **stats}.items():
            self.steps.setdefault(name, []).append(float(value))
        self.part = {}

    def result(self) -> dict[str, float]:
        out = {name: sum(v) / len(v) for name, v in self.steps.items()}
        out |= {name: s / self.weights[name] if self.weights[name] else 0.0
                for name, s in self.sums.items()}
        out |= self.maxima
        for name, (n, sx, sxx) in self.spread.items():       # sample std; 0 below 2 turns
            out[name] = math.sqrt(max(sxx - sx * sx / n, 0.0) / (n - 1)) if n > 1 else 0.0
        return out
