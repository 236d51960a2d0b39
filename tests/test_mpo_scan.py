"""reverse_scan, the recurrence behind every GAE here: x_i = b_i + a_i x_{i+1}, against a plain
loop for every length up to 70 (powers of two and not), any decays (0, 1, negative), leading
batch dimensions; the inputs are left untouched. Tolerance 1e-12 in float64."""

from __future__ import annotations

import torch

import mpo


def loop(b, a):
    x = torch.zeros_like(b)
    nxt = torch.zeros_like(b[..., 0])
    for i in reversed(range(b.shape[-1])):
        nxt = b[..., i] + a[..., i] * nxt
        x[..., i] = nxt
    return x


def test_reverse_scan_matches_a_loop_for_every_length_and_leaves_its_inputs_alone():
    g = torch.Generator().manual_seed(0)
    for n in range(0, 71):
        b = torch.randn(3, 2, n, generator=g, dtype=torch.float64)
        a = torch.randn(3, 2, n, generator=g, dtype=torch.float64)
        a[a.abs() < 0.3] = 0.0                                  # segment ends
        a[..., ::7] = 1.0                                       # pass-through positions
        b0, a0 = b.clone(), a.clone()
        x = mpo.reverse_scan(b, a)
        assert torch.equal(b, b0) and torch.equal(a, a0), n
        err = (x - loop(b, a)).abs().max().item() if n else 0.0
        assert err <= 1e-12 * max(1.0, loop(b, a).abs().max().item() if n else 1.0), (n, err)


def test_reverse_scan_by_hand():
    x = mpo.reverse_scan(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.5, 0.5, 0.5]))
    assert x.tolist() == [1.75, 1.5, 1.0]
    x = mpo.reverse_scan(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 0.0, 1.0, 9.0]))
    assert x.tolist() == [3.0, 2.0, 7.0, 4.0]                  # a = 0 cuts, the last a is unused
