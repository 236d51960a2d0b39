"""Ways to do the fast path's costliest steps that mpo.py does not take, timed beside its own.

    python experiments/benchmarks/alternatives.py                 # one 64x8192 block, 15 repeats
    python experiments/benchmarks/alternatives.py --shape 16x32768

On one block of rows as `mpo_advantages` runs it on the CPU (CPU_BLOCK = 2^19 positions), each
alternative is first checked to give mpo.py's numbers (to float32 rounding), then timed with
bench_mpo.compare (interleaved, shuffled, medians). Printed: ms, and alternative / mpo.py.

  scan      the intra-turn traces (M4). mpo.py: `_scan_padded`, ⌈log2 span⌉ doubling steps of
            two full-size ops, timed with the two copies that refill its inputs (it overwrites
            them; in `_mpo_rows` they are fresh temporaries), and the copies alone. chunked,c: a two-level scan: chunks of c positions transposed
            to (c, N/c), a loop over the c offsets (vectorised over chunks), a scan across
            chunks, the carries added, transposed back. loop,c: its loop alone (no transposes).
  sums      δ^turn (M2). mpo.py: `_turn_sums`, prefix sums in chunks of 64. chunked: sums of
            32-position chunks, their prefix, and each bound's partial chunk from a gathered
            window times a triangular matrix.
  mask      V with junk off the turns set to 0. mpo.py: torch.where. bits: the float's bits and
            an all-ones / all-zeros int mask (exact for NaN junk too).
  bounds    each turn's first and past-the-last position. mpo.py: `_turn_bounds`, a float
            cumsum key and searchsorted. nonzero: the positions where turns begin and end, by torch.nonzero.
"""
import argparse
import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import torch                                          # noqa: E402
import torch.nn.functional as F                       # noqa: E402

import mpo                                            # noqa: E402
from bench_mpo import compare, make_batch, parse_shape  # noqa: E402

CPU = torch.device("cpu")


def padded(x, pad):
    """x (N,) copied into a `_padded_buffer` (N + pad,) with a zero tail."""
    buf = mpo._padded_buffer((), x.numel(), pad, x.dtype, x.device)
    buf[:x.numel()] = x
    return buf


def chunked_scan(b, a, c, span, transposes=True):
    """x_i = b_i + a_i x_{i+1} on a flat (N,) row (a = 0 at the end), N % c == 0, in two levels."""
    N = b.numel()
    M = N // c
    if transposes:
        y, p = torch.empty(c, M), torch.empty(c, M)
        y.copy_(b.view(M, c).t())                     # y[j, m] = b[m c + j]
        p.copy_(a.view(M, c).t())
    else:
        y, p = b.view(c, M).clone(), a.view(c, M).clone()   # the loop's cost alone: not a scan
    for j in range(c - 2, -1, -1):                    # inside each chunk, carry 0 past its end:
        y[j].addcmul_(p[j], y[j + 1])                 # y_j = b_j + a_j y_{j+1}
        p[j].mul_(p[j + 1])                           # p_j = a_j ... a_{c-1}
    if not transposes:
        return y
    chunk_span = min(M, -(-span // c) + 1)            # chunks a segment can touch
    starts = mpo._scan_padded(padded(y[0], chunk_span), padded(p[0], chunk_span), M, chunk_span)
    carry = F.pad(starts[1:], (0, 1))                 # x at the next chunk's first position
    y[1:].addcmul_(p[1:], carry)
    y[0] = starts
    out = torch.empty(N)
    out.view(M, c).copy_(y.t())
    return out


@functools.lru_cache(maxsize=4)
def strict_lower(c, dtype):
    j = torch.arange(c)
    return (j[:, None] < j[None, :]).to(dtype)        # L[j, r] = 1 if j < r


def chunked_sums(x, bounds, c=32):
    """`_turn_sums` from c-position chunk sums and a window per bound (T % c == 0)."""
    B, T = x.shape
    C = T // c
    before = F.pad(x.view(B, C, c).sum(2).double().cumsum(1), (1, 0))          # (B, C + 1)
    chunk = torch.div(bounds, c, rounding_mode="floor")
    rem = bounds - chunk * c
    off = (torch.arange(B)[:, None] * T + chunk.clamp(max=C - 1) * c).view(-1)
    window = x.view(-1).unfold(0, c, 1).index_select(0, off)                     # (B 2K, c)
    part = (window @ strict_lower(c, x.dtype)).gather(1, rem.view(-1, 1)).view(B, -1)
    upto = before.gather(1, chunk) + part
    return (upto[:, 1::2] - upto[:, 0::2]).to(x.dtype)


def masked_bits(values, act_u8, mask32, out):
    """values where act, +0.0 elsewhere, through the float's bits (float32)."""
    torch.neg(act_u8.to(torch.int32), out=mask32)                               # -1 or 0
    return torch.bitwise_and(values.view(torch.int32), mask32, out=out.view(torch.int32)).view(out.dtype)


def nonzero_bounds(act_u8, inside_u8, K):
    """`mpo._turn_bounds` from torch.nonzero of the first and last tokens' markers."""
    B, T = act_u8.shape
    first = act_u8.clone()
    first[:, 1:] -= inside_u8[:, :-1]                                            # 1 at a turn's first
    last = act_u8 - inside_u8                                                    # and last token
    out = torch.full((B, 2 * K), T, dtype=torch.long)
    for col, marker, shift in ((0, first, 0), (1, last, 1)):
        rows, pos = torch.nonzero(marker, as_tuple=True)                         # row-major order
        count = torch.bincount(rows, minlength=B)
        rank = torch.arange(rows.numel()) - F.pad(count.cumsum(0), (1, 0))[rows]  # turn index
        out[rows, 2 * rank + col] = pos + shift
    return out


def block(B, T):
    """One block's inputs as `_mpo_rows` sees them, from bench_mpo's batch."""
    turn_ids, values, rewards = make_batch(B, T, CPU)
    K = int(turn_ids.max()) + 1
    act = turn_ids >= 0
    inside = act.clone()
    inside[:, :-1] &= act[:, 1:] & (turn_ids[:, 1:] == turn_ids[:, :-1])
    inside[:, -1] = False
    span = int(mpo._per_turn_sum(act.long(), turn_ids, K).max())
    return dict(turn_ids=turn_ids, values=values, K=K, act=act, act_u8=act.view(torch.uint8),
                in_u8=inside.view(torch.uint8), decay=(inside.float() * 0.95).view(-1),
                delta=torch.randn(B * T), span=span)


def contenders(d):
    """{group: {name: function}}, mpo.py's op under the name "mpo.py"; each alternative's
    result is checked against mpo.py's before anything is timed (RuntimeError if it differs)."""
    N, span = d["delta"].numel(), d["span"]
    x_pad, a_pad = padded(d["delta"], span), padded(d["decay"], span)
    x_buf, a_buf = torch.empty_like(x_pad), torch.empty_like(a_pad)

    def mpo_scan():                                   # the copies: _scan_padded overwrites
        x_buf.copy_(x_pad), a_buf.copy_(a_pad)        # its inputs (as in _mpo_rows, where
        return mpo._scan_padded(x_buf, a_buf, N, span)   # they are fresh temporaries)
    bounds = mpo._turn_bounds(d["act_u8"], d["in_u8"], d["K"])
    delta = d["delta"].view(d["values"].shape)
    out, mask32 = torch.empty_like(d["values"]), torch.empty(d["values"].shape, dtype=torch.int32)
    zero = torch.zeros(())
    groups = {
        "scan": {"mpo.py": mpo_scan,
                 "(its copies)": lambda: (x_buf.copy_(x_pad), a_buf.copy_(a_pad)),
                 **{f"chunked,{c}": functools.partial(chunked_scan, d["delta"], d["decay"], c, span)
                    for c in (16, 32)},
                 **{f"loop,{c}": functools.partial(chunked_scan, d["delta"], d["decay"], c, span, False)
                    for c in (16, 32)}},
        "sums": {"mpo.py": lambda: mpo._turn_sums(delta, bounds),
                 "chunked": lambda: chunked_sums(delta, bounds)},
        "mask": {"mpo.py": lambda: torch.where(d["act"], d["values"], zero, out=out),
                 "bits": lambda: masked_bits(d["values"], d["act_u8"], mask32, out)},
        "bounds": {"mpo.py": lambda: mpo._turn_bounds(d["act_u8"], d["in_u8"], d["K"]),
                   "nonzero": lambda: nonzero_bounds(d["act_u8"], d["in_u8"], d["K"])},
    }
    for group, fns in groups.items():                 # same numbers first (not the loop-only
        want = fns["mpo.py"]().clone()                # timings, which skip the second level)
        for name, fn in fns.items():
            got = fn()
            if name.startswith(("loop", "(")):
                continue
            same = (torch.equal(got, want) if not want.is_floating_point()
                    else torch.allclose(got, want, rtol=1e-5, atol=1e-5))
            if not same:
                raise RuntimeError(f"alternatives.py: {group} {name} differs from mpo.py")
    return groups


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="64x8192", help="one block, BxT with T a multiple of 32 "
                    "(default 64x8192: CPU_BLOCK positions)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    B, T = parse_shape("alternatives.py", args.shape, "64x8192")
    if B < 1 or T < 512 or T % 32 or args.repeats < 1:
        raise SystemExit("alternatives.py: --shape needs B >= 1 and T >= 512 a multiple of 32, "
                         "--repeats >= 1")
    groups = contenders(block(B, T))
    print(f"one block {B}x{T} ({B * T} positions), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats} interleaved repeats")
    for group, fns in groups.items():
        t = compare(fns, CPU, args.repeats)
        print(f"{group:7} " + "  ".join(
            f"{name} {t[name] * 1e3:.3f} ms" + ("" if name == "mpo.py" else f" ({t[name] / t['mpo.py']:.2f}x)")
            for name in fns), flush=True)


if __name__ == "__main__":
    main()
