/* cdef
int worker(struct lane *lanes, size_t nlanes, uint64_t *total, int *stop, int *failed_lane);
*/
/* Chapter 12's worker: chapter 11's loop, unchanged.
 *
 * What changed is where it runs. Python pins each worker thread to the core
 * chapter 08 picked for its GPU, and only then allocates the thread's lanes
 * (contexts, free list, pending ring), so that their memory is first touched,
 * and placed, on that core's NUMA node (chapters/12_pin.py). The scheduler
 * no longer moves the thread, and its caches stay warm.
 */
#include "engine/lane.h"

static ssize_t visit(struct lane *l, void *total)
{
    ssize_t rc = submit(l, 1);  /* one new WRITE per visit, as in the series */
    if (rc == 0)
        rc = reap(l);
    if (rc > 0)  /* every worker adds to the same total */
        __atomic_add_fetch((uint64_t *)total, (uint64_t)rc, __ATOMIC_RELAXED);
    if (rc >= 0)  /* also with nothing completed: a refusal may be over */
        rc = drain(l, l->nslots);
    return rc;
}

int worker(struct lane *lanes, size_t nlanes, uint64_t *total, int *stop, int *failed_lane)
{
    return run_lanes(lanes, nlanes, stop, failed_lane, visit, total);
}
