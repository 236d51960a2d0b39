"""reverse_scan, the recurrence behind every GAE here: x_i = b_i + a_i x_{i+1}, against a plain
loop for every length up to 70 (powers of two and not), any decays (0, 1, negative), leading
batch dimensions; the inputs are left untouched; the private scratch variant gives the same
numbers, and so does the fused body's padded variant (`_scan_padded`) within its bound.
Tolerance 1e-12 in float64."""

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
        y = mpo._reverse_scan(b.clone(), a.clone(), scratch=True)
        assert torch.equal(x, y), n


def test_reverse_scan_by_hand():
    x = mpo.reverse_scan(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.5, 0.5, 0.5]))
    assert x.tolist() == [1.75, 1.5, 1.0]
    x = mpo.reverse_scan(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 0.0, 1.0, 9.0]))
    assert x.tolist() == [3.0, 2.0, 7.0, 4.0]                  # a = 0 cuts, the last a is unused


def test_max_turn_len_shortens_the_scan_without_changing_a_number():
    """mpo_advantages(max_turn_len=L): the intra-turn scan stops after ⌈log2 L⌉ steps; any bound
    >= the longest turn gives the same numbers, a smaller one is refused."""
    from conftest import Layout, RowLayout, make_batch
    b = make_batch(Layout([RowLayout(3, [5, 1, 7], [2, 3, 1], False),
                           RowLayout(0, [2, 6], [4, 0], True)], extra_pad=9), seed=3)
    full = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids)
    for bound in (7, 8, 9, 100):
        for validate in (True, False):
            got = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, max_turn_len=bound,
                                     validate=validate)
            assert all(torch.equal(g, f) for g, f in zip(got, full)), (bound, validate)
    # a bound below the longest turn (7) would cut it: refused under validation, and wrong without
    for bad in (6, 0, 2.5, True):
        try:
            mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, max_turn_len=bad)
            raise AssertionError(f"max_turn_len={bad} accepted")
        except ValueError as e:
            assert "max_turn_len" in str(e) and "7 tokens" in str(e)
    short = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, max_turn_len=2, validate=False)
    assert not torch.equal(short[0], full[0])


def test_padded_scan_matches_the_loop_within_its_bound_and_stops_at_it():
    """_scan_padded (the fused body's scan, on buffers with a zero tail) gives the loop's
    numbers for every length up to 70, one and two recurrences over the same decays, whenever
    every segment (a run of non-zero decays, plus one) is at most `span` long; with a `span`
    below the longest segment it stops early (a different, truncated sum)."""
    g = torch.Generator().manual_seed(1)
    for n in range(1, 71):
        for seg in sorted({1, 2, 3, 5, 8, 13, n}):
            a = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
            a[seg - 1::seg] = 0.0                               # segments of at most seg positions
            a[-1] = 0.0
            b = torch.randn(2, n, generator=g, dtype=torch.float64)
            expect = loop(b, a.expand(2, n))
            for shape in ((), (2,)):
                bb = b if shape else b[0]
                for span in sorted({seg, seg + 1, n}):
                    span = min(span, n)
                    xbuf = mpo._padded_buffer(shape, n, span, torch.float64, "cpu")
                    abuf = mpo._padded_buffer((), n, span, torch.float64, "cpu")
                    xbuf[..., :n], abuf[:n] = bb, a
                    got = mpo._scan_padded(xbuf, abuf, n, span)
                    want = expect if shape else expect[0]
                    assert (got - want).abs().max() <= 1e-12 * max(1.0, want.abs().max()), (n, seg, span)
    # a bound below the longest segment truncates: x_0 misses b's tail beyond the bound
    n = 16
    a = torch.full((n,), 0.5, dtype=torch.float64); a[-1] = 0.0
    xbuf = mpo._padded_buffer((), n, 4, torch.float64, "cpu"); xbuf[:n] = 1.0
    abuf = mpo._padded_buffer((), n, 4, torch.float64, "cpu"); abuf[:n] = a
    got = mpo._scan_padded(xbuf, abuf, n, 4)
    assert abs(float(got[0]) - sum(0.5 ** k for k in range(4))) < 1e-15
