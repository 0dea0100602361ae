"""fp8 and bf16, the two number formats that travel between GPUs here, computed the plain
way (numpy, or cupy for a cupy array): the twin of fp8.cuh, which the kernels' bytes are
checked against byte for byte. numpy has neither dtype, so both are raw integers:
- fp8 e4m3 ("e4m3fn": 1 sign, 4 exponent bits with bias 7, 3 mantissa bits,
  largest finite value 448, no infinities) in uint8, with one float32 scale per
  block (1 x 128 values of a token, 128 x 128 of a weight): x ~ decode(q) * scale,
  scale = max|x| of the block / 448.
- bf16 (the top half of a float32, rounded to nearest even) in uint16.
"""
import numpy as np

FP8_BLOCK = 128     # values per fp32 scale
FP8_MAX = 448.0     # largest finite e4m3 value


def _e4m3_values():
    """The value of each non-negative finite e4m3 code 0..126, increasing."""
    codes = np.arange(127)
    exponent, mantissa = codes >> 3, (codes & 7).astype(np.float64)
    return np.where(exponent == 0, mantissa / 8 * 2.0 ** -6,
                    (1 + mantissa / 8) * 2.0 ** (exponent - 7)).astype(np.float32)


E4M3 = _e4m3_values()


def to_e4m3(x):
    """float32 -> uint8 e4m3 codes: nearest value (ties to the even code), saturating at
    +-448 as fp8 conversions for training do. numpy, or cupy for a cupy array."""
    xp = array_module(x)
    table = xp.asarray(E4M3)
    a = xp.minimum(xp.abs(x).astype(xp.float32), FP8_MAX)
    upper = xp.clip(xp.searchsorted(table, a), 1, len(E4M3) - 1)
    lower = upper - 1
    below, above = a - table[lower], table[upper] - a
    pick_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    code = xp.where(pick_upper, upper, lower).astype(xp.uint8)
    return code | xp.where(xp.signbit(x), 0x80, 0).astype(xp.uint8)


def from_e4m3(code):
    value = E4M3[code & 0x7F]
    return np.where(code & 0x80, -value, value).astype(np.float32)


def array_module(array):
    """numpy, or cupy for a cupy array: the bf16 conversions run on either."""
    if type(array).__module__.partition(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def to_bf16(x):
    """float32 -> uint16 bf16, rounded to nearest even (NaN stays NaN)."""
    xp = array_module(x)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    bits = x.view(xp.uint32)
    rounded = (bits >> 16) & 1
    rounded += 0x7FFF
    rounded += bits  # wraps only for NaNs with every bit set, replaced below
    half = (rounded >> 16).astype(xp.uint16)
    return xp.where(xp.isnan(x), xp.uint16(0x7FC0), half)


def from_bf16(half):
    xp = array_module(half)
    return (xp.asarray(half, dtype=xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


def quantize_fp8(x, block_rows=1):
    """(rows, cols) float32 -> (uint8 codes (rows, cols), float32 scales (rows / block_rows,
    cols / 128)): one scale per block of block_rows x 128 values, 1 x 128 for activations
    (chapters 16-17), 128 x 128 for weights as fp8 checkpoints keep them (chapter 19).
    numpy, or cupy for a cupy array."""
    xp = array_module(x)
    rows, cols = x.shape
    blocks = x.reshape(rows // block_rows, block_rows, cols // FP8_BLOCK, FP8_BLOCK)
    scales = fp8_scales(xp.abs(blocks).max(axis=(1, 3)))
    codes = to_e4m3(blocks / scales[:, None, :, None])
    return codes.reshape(x.shape), scales


def fp8_scales(amax):
    """A block's scale from its largest magnitude: amax / 448, or 1 where all are zero."""
    xp = array_module(amax)
    return xp.where(amax > 0, amax / FP8_MAX, 1.0).astype(xp.float32)


def dequantize_fp8(codes, scales):
    blocks = from_e4m3(codes).reshape(len(codes), codes.shape[1] // FP8_BLOCK, FP8_BLOCK)
    return (blocks * scales[:, :, None]).reshape(codes.shape)
