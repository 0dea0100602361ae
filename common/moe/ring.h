/* The MoE proxy's ring entry: one WRITE the device side asks the proxy for. The ring is in
   host memory; chapter 16's numpy or chapter 17's kernels write it, the proxy's loop
   (proxy.c) reads it. One declaration for both: proxy.c is compiled with it ahead
   (common/_build_native.py) and chapters/17_gpu_driven.cu includes it. Plain C types,
   which NVRTC knows without a header. */
struct m16_write {
    unsigned long long local, remote;  /* byte offsets into this rank's and the peer's region */
    unsigned long long len;
    unsigned int peer;                 /* the peer's rank */
    unsigned int imm;                  /* immediate data: what the peer's proxy will see */
};
