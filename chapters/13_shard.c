/* cdef
struct counter {            // one worker's count of completed WRITEs, alone on its cache
    uint8_t before[64];     // line: the padding keeps every other variable off that line
    uint64_t value;
    uint8_t after[56];
};
int worker(struct lane *lanes, size_t nlanes, struct counter *done, int *stop,
           int *failed_lane);
*/
/* Chapter 13's worker: chapter 12's, with its own counter instead of a shared one.
 *
 * In chapter 12 every worker adds its completions to one shared total with
 * an atomic add: a locked instruction on a cache line that the other workers
 * (and the thread watching) keep taking away. Now each worker writes only its
 * own counter, on a cache line of its own; the main thread adds them up when
 * it wants a total. Nothing a worker writes is written by another thread.
 */
#include "engine/lane.h"

static ssize_t visit(struct lane *l, void *counter)
{
    struct counter *done = counter;
    ssize_t rc = submit(l, 1);  /* one new WRITE per visit, as in the series */
    if (rc == 0)
        rc = reap(l);
    if (rc > 0)  /* its only writer: a plain store the main thread may read */
        __atomic_store_n(&done->value, done->value + (uint64_t)rc, __ATOMIC_RELAXED);
    if (rc >= 0)  /* also with nothing completed: a refusal may be over */
        rc = drain(l, l->nslots);
    return rc;
}

int worker(struct lane *lanes, size_t nlanes, struct counter *done, int *stop,
           int *failed_lane)
{
    return run_lanes(lanes, nlanes, stop, failed_lane, visit, done);
}
