"""Where the sections of a region start: on a cache line, so that no two share one and the
kernels' 16-byte copies fit (device.cuh's copy_row). The MoE chapters lay out their
ranks' regions so, chapter 19 its tensors."""
ALIGN = 64  # bytes


def aligned(size):
    return -(-size // ALIGN) * ALIGN
