"""fp8 e4m3 and bf16 as numpy integers (common/gpu/rounding.py): known codes, every code
there and back, and the error of block quantisation."""
import numpy as np
import pytest

from common.gpu import rounding


@pytest.mark.parametrize("value,code", [
    (0.0, 0x00), (1.0, 0x38), (0.5, 0x30), (2.0, 0x40), (-2.0, 0xC0), (448.0, 0x7E),
    (1000.0, 0x7E), (-1000.0, 0xFE), (2.0 ** -9, 0x01),  # saturation; the smallest subnormal
    (1.0625, 0x38), (1.1875, 0x3A),  # halfway: to the even code
    (1.07, 0x39),
])
def test_e4m3_known_codes(value, code):
    assert int(rounding.to_e4m3(np.array([value], np.float32))[0]) == code
    if abs(value) <= 448:
        assert abs(float(rounding.from_e4m3(np.array([code], np.uint8))[0]) - value) <= abs(value) / 16


def test_e4m3_every_code_round_trips():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)  # all but NaN
    assert np.array_equal(rounding.to_e4m3(rounding.from_e4m3(codes)), codes)
    assert rounding.from_e4m3(np.array([0x7E], np.uint8))[0] == rounding.FP8_MAX


@pytest.mark.parametrize("value,half", [
    (1.0, 0x3F80), (-2.0, 0xC000), (1 + 2 ** -8, 0x3F80), (1 + 3 * 2 ** -8, 0x3F82),
    (1 + 2 ** -7, 0x3F81),
])
def test_bf16_rounds_to_nearest_even(value, half):
    assert int(rounding.to_bf16(np.array([value], np.float32))[0]) == half
    assert abs(float(rounding.from_bf16(np.array([half], np.uint16))[0]) - value) <= abs(value) / 256


def test_fp8_block_quantisation_error_is_bounded():
    x = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
    x[1, :128] *= 1000  # each block has its own scale: the next block keeps its precision
    codes, scales = rounding.quantize_fp8(x)
    assert codes.dtype == np.uint8 and scales.shape == (5, 2) and scales.dtype == np.float32
    error = np.abs(rounding.dequantize_fp8(codes, scales) - x)
    bound = np.abs(x) / 16 + np.repeat(scales, 128, axis=1) * 2.0 ** -10
    assert (error <= bound).all()
    assert np.isclose(np.abs(rounding.dequantize_fp8(codes, scales)).max(axis=1),
                      np.abs(x).max(axis=1), rtol=1e-6).all()  # the block maximum is exact
