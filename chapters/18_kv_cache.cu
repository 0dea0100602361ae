// Chapter 18's one kernel: the GPU says a layer is done, in host memory a watcher thread
// polls (pinned, so mapped at the same address), with the GPU's clock at that moment.
extern "C" __global__ void kv_bump(volatile long long *counter, long long layers_done,
                                   volatile unsigned long long *ns)
{
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    ns[layers_done - 1] = now;
    __threadfence_system();  // the time first, then the count the watcher looks at
    counter[0] = layers_done;
}
