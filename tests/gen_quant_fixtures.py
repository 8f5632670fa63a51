#!/usr/bin/env python3
"""Generate the quantization fixtures in tests/data/quant/ with the PyPI `gguf` package.

The `gguf` package (numpy) is an implementation of ggml's block formats independent of ours:
tests/test_quant.cpp checks that Baton's dequantize gives bit-identical float32 output and that
Baton's quantize gives identical bytes wherever the package can quantize.

Regenerate (not needed for building or testing; the outputs are committed):
    python3 -m venv /tmp/gguf-venv && /tmp/gguf-venv/bin/pip install gguf numpy
    /tmp/gguf-venv/bin/python tests/gen_quant_fixtures.py

Files written for each type T (all little-endian, no headers; sizes give the counts):
    T.dq.bin   random blocks (random bytes, but finite fp16 scales)
    T.dq.f32   the package's dequantization of T.dq.bin
    T.q.f32    random float32 rows (only for types the package quantizes)
    T.q.bin    the package's quantization of T.q.f32
MANIFEST.txt records the package versions and the seed. The k-quant quantize fixtures
(*.ggml.q.*) come from ggml itself: see tests/gen_ggml_quant_fixtures.sh.
"""
import os
from importlib import metadata
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

SEED = 20261202
K_BLOCKS = 16  # per k-quant type (256 elements each)
LEGACY_BLOCKS = 64  # per legacy type (32 elements each)
FLOAT_ELEMS = 1024  # for F16 / BF16 fixtures

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "quant")

# Byte offsets of the fp16 scale fields in each block (see quant/blocks.h).
SCALE_OFFSETS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}
QUANTIZED = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Types added later draw from their own streams (seeded by SEED and the type id), so that adding
# one leaves every earlier fixture's bytes as they were. Dequantize fixtures, and quantize ones for
# the later types the package quantizes. MXFP4's scale is a byte: all 256 values are fair game
# (e = 255 reads as 2^127, so a block's ±6 levels there dequantize to ±inf in float32, as in ggml).
LATER_SCALE_OFFSETS = {Q.IQ4_NL: [0], Q.IQ4_XS: [0], Q.MXFP4: []}
LATER_QUANTIZED = [Q.MXFP4]


def block_count(qtype):
    return K_BLOCKS if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else LEGACY_BLOCKS


def sane_halves(rng, n):
    """Finite fp16 scales of both signs over a wide range, with a few zeros and subnormals."""
    mag = np.exp2(rng.uniform(-16.0, 4.0, n)).astype(np.float32)
    sign = np.where(rng.random(n) < 0.2, -1.0, 1.0).astype(np.float32)
    h = (mag * sign).astype(np.float16)
    h[rng.random(n) < 0.05] = 0.0
    h[rng.random(n) < 0.05] = np.float16(rng.integers(1, 1024) * 2.0 ** -24)  # subnormal
    return h


def random_blocks(rng, qtype, offsets=SCALE_OFFSETS):
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    nb = block_count(qtype)
    raw = rng.integers(0, 256, size=(nb, block_bytes), dtype=np.uint8)
    for off in offsets[qtype]:
        raw[:, off:off + 2] = sane_halves(rng, nb).view(np.uint8).reshape(nb, 2)
    return raw.reshape(-1)


def random_halfwords(rng, n):
    """Random 16-bit patterns with NaNs replaced (fp16 and bf16 share the NaN test shape)."""
    return rng.integers(0, 65536, size=n, dtype=np.uint32).astype(np.uint16)


def quantize_inputs(rng, qtype):
    """Rows that exercise the rounding rules: Gaussian blocks of varied scale, a heavy-tailed
    block, an outlier, a constant block, an all-zero block, exact half-step grids, tiny values."""
    block_elems = gguf.GGML_QUANT_SIZES[qtype][0]
    nb = block_count(qtype)
    x = np.empty((nb, block_elems), dtype=np.float32)
    for b in range(nb):
        scale = np.float32(2.0 ** rng.uniform(-10, 6))
        x[b] = rng.standard_normal(block_elems).astype(np.float32) * scale
    x[1] = rng.standard_cauchy(block_elems).astype(np.float32)
    x[2, 7] *= 40.0
    x[3] = np.float32(0.37)
    x[4] = 0.0
    # Values k/4 and k/8: x/d lands exactly on .5 boundaries for several formats.
    x[5] = (np.arange(block_elems) % 32 - 16).astype(np.float32) * np.float32(0.25)
    x[6] = (np.arange(block_elems) % 64 - 31).astype(np.float32) * np.float32(0.125)
    x[7] = rng.standard_normal(block_elems).astype(np.float32) * np.float32(1e-6)
    x[8] = np.abs(x[8])  # all positive: min clamps to zero in the affine formats
    x[9] = -np.abs(x[9])
    return x.reshape(-1)


def special_floats(rng):
    """float32 values around fp16/bf16 rounding edges: ties, subnormals, overflow, NaN/inf."""
    bits = rng.integers(0, 2**32, size=FLOAT_ELEMS, dtype=np.uint64).astype(np.uint32)
    vals = bits.view(np.float32).copy()
    # Many values in the fp16 range (normal and subnormal), some exact ties.
    k = FLOAT_ELEMS // 4
    vals[:k] = (rng.standard_normal(k) * np.exp2(rng.uniform(-26, 16, k))).astype(np.float32)
    ties = np.float16(rng.standard_normal(64)).astype(np.float32)
    # Halfway to the next half: the fp16 ulp is 2^(e-10); add half of it.
    e = np.floor(np.log2(np.abs(ties) + 1e-30))
    vals[k:k + 64] = ties + np.sign(ties) * np.exp2(e - 11).astype(np.float32)
    edge = np.array([65504, 65519.996, 65520, 65536, 1e9, -65520, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001,
                     2.0**-26, 2.0**-14, 2.0**-14 - 2.0**-25, 0.0, -0.0, np.inf, -np.inf,
                     3 * 2.0**-25, 5 * 2.0**-26], dtype=np.float32)
    vals[k + 64:k + 64 + len(edge)] = edge
    return vals


def write(name, arr):
    path = os.path.join(OUT, name)
    arr.tofile(path)
    return os.path.getsize(path)


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(SEED)
    total = 0
    for qtype in SCALE_OFFSETS:
        blocks = random_blocks(rng, qtype)
        total += write(f"{qtype.name}.dq.bin", blocks)
        total += write(f"{qtype.name}.dq.f32", dequantize(blocks, qtype).astype(np.float32))
        if qtype in QUANTIZED:
            x = quantize_inputs(rng, qtype)
            try:
                q = quantize(x, qtype)
            except NotImplementedError:
                continue
            total += write(f"{qtype.name}.q.f32", x)
            total += write(f"{qtype.name}.q.bin", q.astype(np.uint8))

    # Plain float formats: dequant of random bit patterns (NaNs excluded: payloads are not the
    # point here), quantize of values around every rounding edge (NaN included for BF16).
    f = rng.integers(0, 2**32, size=FLOAT_ELEMS, dtype=np.uint64).astype(np.uint32)
    f = f[(f & 0x7FFFFFFF) <= 0x7F800000]
    total += write("F32.dq.bin", f)
    total += write("F32.dq.f32", dequantize(f.view(np.uint8), Q.F32).astype(np.float32))
    for qtype in (Q.F16, Q.BF16):
        h = random_halfwords(rng, FLOAT_ELEMS)
        h = h[(h & 0x7FFF) <= (0x7C00 if qtype == Q.F16 else 0x7F80)]
        total += write(f"{qtype.name}.dq.bin", h)
        total += write(f"{qtype.name}.dq.f32", dequantize(h.view(np.uint8), qtype).astype(np.float32))
        x = special_floats(rng)
        if qtype == Q.F16:
            x = x[~np.isnan(x)]
        else:
            x[-3:] = np.array([np.nan, -np.nan, np.float32(np.nan)], dtype=np.float32)
            x[-2] = np.uint32(0x7F800001).view(np.float32)  # signalling NaN: must come back quiet
        with np.errstate(over="ignore"):  # overflow to inf is one of the cases
            q = quantize(x, qtype)
        total += write(f"{qtype.name}.q.f32", x)
        total += write(f"{qtype.name}.q.bin", q.view(np.uint8))

    for qtype, offsets in LATER_SCALE_OFFSETS.items():
        later = np.random.default_rng([SEED, int(qtype)])
        blocks = random_blocks(later, qtype, LATER_SCALE_OFFSETS)
        total += write(f"{qtype.name}.dq.bin", blocks)
        with np.errstate(over="ignore"):
            total += write(f"{qtype.name}.dq.f32", dequantize(blocks, qtype).astype(np.float32))
        if qtype in LATER_QUANTIZED:
            x = quantize_inputs(later, qtype)
            total += write(f"{qtype.name}.q.f32", x)
            total += write(f"{qtype.name}.q.bin", quantize(x, qtype).astype(np.uint8))

    manifest = os.path.join(OUT, "MANIFEST.txt")
    keep = []  # lines written by tests/gen_ggml_quant_fixtures.sh
    if os.path.exists(manifest):
        keep = [line for line in open(manifest) if line.startswith("ggml-quants.c ")]
    with open(manifest, "w") as f:
        f.write("generated by tests/gen_quant_fixtures.py\n")
        f.write(f"gguf {metadata.version('gguf')}; numpy {np.__version__}; seed {SEED}; "
                f"{K_BLOCKS} blocks per k-quant type, {LEGACY_BLOCKS} per legacy type\n")
        f.writelines(keep)
    print(f"wrote {total} bytes to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
