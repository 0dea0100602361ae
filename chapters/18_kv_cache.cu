// Chapter 18's one kernel: the GPU says a layer is done, in host memory a watcher thread
// polls (pinned, so mapped at the same address), with the GPU's clock at that moment.
#include "device.cuh"  // common/gpu/: gpu_now, the GPU's global timer

extern "C" __global__ void kv_bump(volatile long long *counter, long long layers_done,
                                   volatile unsigned long long *ns)
{
    ns[layers_done - 1] = gpu_now();
    __threadfence_system();  // the time first, then the count the watcher looks at
    counter[0] = layers_done;
}
