"""The reference of chapter 16: fp8 e4m3 and bf16 as numpy integers, dispatch and combine
worked by hand, and the routing of each checked case."""
import numpy as np
import pytest

from common.moe import reference as ref


@pytest.mark.parametrize("value,code", [
    (0.0, 0x00), (1.0, 0x38), (0.5, 0x30), (2.0, 0x40), (-2.0, 0xC0), (448.0, 0x7E),
    (1000.0, 0x7E), (-1000.0, 0xFE), (2.0 ** -9, 0x01),  # saturation; the smallest subnormal
    (1.0625, 0x38), (1.1875, 0x3A),  # halfway: to the even code
    (1.07, 0x39),
])
def test_e4m3_known_codes(value, code):
    assert int(ref.to_e4m3(np.array([value], np.float32))[0]) == code
    if abs(value) <= 448:
        assert abs(float(ref.from_e4m3(np.array([code], np.uint8))[0]) - value) <= abs(value) / 16


def test_e4m3_every_code_round_trips():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)  # all but NaN
    assert np.array_equal(ref.to_e4m3(ref.from_e4m3(codes)), codes)
    assert ref.from_e4m3(np.array([0x7E], np.uint8))[0] == ref.FP8_MAX


@pytest.mark.parametrize("value,half", [
    (1.0, 0x3F80), (-2.0, 0xC000), (1 + 2 ** -8, 0x3F80), (1 + 3 * 2 ** -8, 0x3F82),
    (1 + 2 ** -7, 0x3F81),
])
def test_bf16_rounds_to_nearest_even(value, half):
    assert int(ref.to_bf16(np.array([value], np.float32))[0]) == half
    assert abs(float(ref.from_bf16(np.array([half], np.uint16))[0]) - value) <= abs(value) / 256


def test_fp8_block_quantisation_error_is_bounded():
    x = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
    x[1, :128] *= 1000  # each block has its own scale: the next block keeps its precision
    codes, scales = ref.quantize_fp8(x)
    assert codes.dtype == np.uint8 and scales.shape == (5, 2) and scales.dtype == np.float32
    error = np.abs(ref.dequantize_fp8(codes, scales) - x)
    bound = np.abs(x) / 16 + np.repeat(scales, 128, axis=1) * 2.0 ** -10
    assert (error <= bound).all()
    assert np.isclose(np.abs(ref.dequantize_fp8(codes, scales)).max(axis=1),
                      np.abs(x).max(axis=1), rtol=1e-6).all()  # the block maximum is exact


def test_dispatch_and_combine_by_hand():
    # 2 ranks, 4 experts: rank 0 hosts 0-1, rank 1 hosts 2-3
    a, b, c = (np.full((1, 2), v) for v in (1, 2, 3))
    indices = [np.array([[0, 2], [1, 0]]), np.array([[3, 1]])]
    rows = [np.concatenate([a, b]), c]
    got, counts = ref.dispatch(0, 2, 4, indices, rows)
    assert counts.tolist() == [2, 2]  # expert 0: a, b (rank 0); expert 1: b (rank 0), c (rank 1)
    assert got[:, 0].tolist() == [1, 2, 2, 3]
    got, counts = ref.dispatch(1, 2, 4, indices, rows)
    assert counts.tolist() == [1, 1] and got[:, 0].tolist() == [1, 3]
    out = ref.combine(np.array([[0, 2]]), np.array([[0.25, 0.75]], np.float32),
                      np.array([[[4.0], [8.0]]], np.float32))
    assert out.tolist() == [[7.0]]


@pytest.mark.parametrize("case", list(ref.CASES))
def test_routing_of_each_case(case):
    world, tokens, experts, topk = 4, 16, 16, 3
    routes = [ref.routing(case, 7, r, world, tokens, experts, topk) for r in range(world)]
    for r, (indices, weights) in enumerate(routes):
        assert indices.shape[1] == topk and weights.shape == indices.shape
        assert len(indices) <= tokens and ((0 <= indices) & (indices < experts)).all()
        assert (np.diff(np.sort(indices, axis=1), axis=1) > 0).all()  # distinct experts
        assert np.allclose(weights.sum(axis=1), 1)
    used = np.concatenate([i.ravel() for i, _ in routes])
    sizes = [len(i) for i, _ in routes]
    if case == "empty-expert":
        assert len(set(used.tolist())) == experts - 1
    if case == "one-expert":
        assert (np.bincount(used, minlength=experts)[:topk] == world * tokens).all()
    if case == "silent-rank":
        assert sizes == [tokens] * (world - 1) + [0]
    if case == "fewer":
        assert max(sizes) < tokens
    assert ref.routing(case, 7, 1, world, tokens, experts, topk)[0].tolist() == \
        routes[1][0].tolist()  # the same seed, the same routing on every rank
