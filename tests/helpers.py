"""Helpers shared by the tests: run_main for the tests that run train_min.py's main loop
in-process, randomise_lora_b for the tests that need LoRA adapters that change the output."""
from __future__ import annotations

import torch

from experiments.grid import train as run_main  # noqa: F401  main(argv), signal handlers restored


def randomise_lora_b(model: torch.nn.Module, std: float,
                     seed: int | torch.Generator | None = None, *,
                     value_head: torch.nn.Module | None = None,
                     value_head_std: float | None = None) -> torch.Generator | None:
    """Set every LoRA B matrix of `model` (both adapters; PEFT starts them at zero, so the adapted
    model would equal the base) to `std` * N(0, 1), in `model.named_parameters()` order, in place.

    seed: an int (a fresh CPU torch.Generator seeded with it), a torch.Generator (drawn from and
    left advanced), or None (torch's global RNG, as after torch.manual_seed). With `value_head`,
    its parameters (weight, then bias) are drawn next from the same source, at `value_head_std`.
    The draws are made on the CPU in float32 and copied into the parameters (for a float32
    parameter the same numbers as `p.normal_(0, std)`). Returns the generator used (None for the
    global RNG), so a test can keep drawing from it.
    """
    g = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    params = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert params, "the model has no LoRA B parameters"
    stds = [std] * len(params)
    if value_head is not None:
        assert value_head_std is not None, "value_head needs value_head_std"
        vh = list(value_head.parameters())
        params, stds = params + vh, stds + [value_head_std] * len(vh)
    with torch.no_grad():
        for p, s in zip(params, stds):
            p.copy_(s * torch.randn(p.shape, generator=g))
    return g
