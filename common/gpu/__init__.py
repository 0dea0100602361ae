"""What any chapter's GPU code stands on, whichever chapter it serves: cuda_driver, the few
CUDA driver calls made through cffi; kernel_call, kernel launches at the driver's cost;
device.cuh, device helpers (the GPU's clock, a block's sum, row copies, bf16); fp8.cuh,
fp8 e4m3 on the GPU, and rounding, its twin in numpy (bf16 too); bf16, bf16 matrix
products on the tensor cores; layout, sections of a region on cache lines. A kernel's
source includes the headers by name, compiled with INCLUDE among its options.
"""
import os

INCLUDE = "-I" + os.path.dirname(os.path.abspath(__file__))  # for cupy.RawModule's options
