"""Block-wise 8-bit codes with one fp32 absmax scale per block (the bitsandbytes / torchao scheme).

Values are normalized by their block's absolute maximum and stored as the index of the
nearest entry of a 256-entry *dynamic* (tree) quantization map: roughly logarithmic, so
small values — most of Adam's moments — keep relative precision. The signed map stores the
first moment, the unsigned map the second. Every operation is per element or per block, so
quantizing a shard whose start is block-aligned gives exactly the codes the full tensor gets.

The unsigned map never rounds a positive value to 0: its smallest code (3.25e-7 of the block's
maximum) is a floor. Adam divides by the square root of the second moment, and an element whose
squared gradient is below ~1.6e-7 of its block's largest (a rare token's embedding row beside a
frequent one's) would otherwise get ``v = 0`` beside a first moment that is not 0: an update of
``lr * m / eps``, thousands of times ``lr`` (the "zero-point problem" of Li et al., 2023, *Memory
Efficient Optimizers with 4-bit States*). The floor makes such a ``v`` larger than it is, so the
update is smaller than AdamW's, never larger.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=None)
def dynamic_map(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> tuple[float, ...]:
    """bitsandbytes' ``create_dynamic_map``: 2**total_bits sorted code values in [-1, 1] (or [0, 1])."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        exponent = non_sign_bits - max_exponent_bits + i + (0 if signed else 1)
        fraction_items = 2**exponent + 1
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float64)
        means = ((boundaries[:-1] + boundaries[1:]) / 2.0).tolist()
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += [scale * m for m in means]
        if signed:
            data += [-scale * m for m in means]
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float64)
        means = ((boundaries[:-1] + boundaries[1:]) / 2.0).tolist()
        scale = 10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)
        data += [scale * m for m in means]
        if signed:
            data += [-scale * m for m in means]
    data += [0.0, 1.0]
    data += [0.0] * (2**total_bits - len(data))
    return tuple(sorted(data))


@functools.lru_cache(maxsize=None)
def _tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.tensor(dynamic_map(signed), dtype=torch.float32, device=device)
    midpoints = (codes[1:] + codes[:-1]) / 2
    return codes, midpoints


def num_blocks(numel: int, block_size: int) -> int:
    return math.ceil(numel / block_size)


def quantize_blockwise(values: torch.Tensor, block_size: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes shaped like ``values``, fp32 absmax per block of ``block_size`` from its start)."""
    flat = values.reshape(-1).float()
    blocks = num_blocks(flat.numel(), block_size)
    padded = torch.nn.functional.pad(flat, (0, blocks * block_size - flat.numel())).view(blocks, block_size)
    scales = padded.abs().amax(dim=1)
    normalized = padded / torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
    _, midpoints = _tables(signed, flat.device)
    codes = torch.bucketize(normalized, midpoints)
    if not signed:  # a positive value keeps at least the smallest positive code (see the module doc)
        codes = torch.where(normalized > 0, codes.clamp(min=1), codes)
    codes = codes.to(torch.uint8)
    return codes.view(-1)[: flat.numel()].view(values.shape), scales


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, block_size: int, signed: bool) -> torch.Tensor:
    """fp32 values of ``codes`` (flat) under per-block ``scales``."""
    table, _ = _tables(signed, codes.device)
    numel = codes.numel()
    blocks = scales.numel()
    values = table[codes.reshape(-1).long()]
    values = torch.nn.functional.pad(values, (0, blocks * block_size - numel)).view(blocks, block_size)
    return (values * scales.unsqueeze(1)).view(-1)[:numel]
