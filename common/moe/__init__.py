"""The scaffolding of the MoE chapters (16-17): an expert-parallel all-to-all.

bookkeeping: the layer's shape, the wire format and where each selection goes, whatever
moves the bytes; reference: what dispatch and combine must produce (numpy) and the inputs
to check them with; memory: where the ranks keep their bytes (host or GPU) and what does
the kernels' work; kernel_call: CUDA kernel launches at the driver's cost; nvlink: the
all-to-all driven by the GPU; nccl: the baseline, the same all-to-all moved by NCCL.
"""
