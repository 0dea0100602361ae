"""The scaffolding of the MoE chapters (16-17): an expert-parallel all-to-all.

bookkeeping: the layer's shape, the wire format and where each selection goes, whatever
moves the bytes; reference: what dispatch and combine must produce (numpy) and the inputs
to check them with; harness: the chapters' flags, checks, benchmark and records; proxy:
what chapter 16's proxy loop drives (its NICs, their endpoints, the peers' addresses);
memory: where the ranks keep their bytes (host or GPU) and what does the kernels' work;
nccl: the baseline, the same all-to-all moved by NCCL; serving: a serving engine's arrays
(cupy or torch) and stream at chapter 17's door; graphs: chapter 17's layer in a CUDA
graph, checked and timed. The protocol itself is in chapters/16_moe.py, the GPU driving
it in chapters/17_gpu_driven.py; what any GPU code stands on (the fp8 wire format on the
GPU, kernel launches) in common/gpu/.
"""
