/* cdef
int worker(struct lane *lanes, size_t nlanes, uint64_t *total, int *stop, int *failed_lane);
*/
/* Chapter 11's worker: the loop of chapters 09-10, in C, for one thread.
 *
 * Python starts one thread per GPU and calls worker() in it; cffi releases
 * the GIL for the call, so the threads really run at the same time. A visit
 * to a lane is the one of common/engine/multinet.py: submit one new WRITE (a refused
 * one waits in the lane's pending ring, in order), read the CQ, retry what
 * waits. The moves themselves (post, submit, drain, reap) are in
 * common/engine/lane.h, which chapters 12-15 share. The count of completed WRITEs is
 * shared by all threads: an atomic add.
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
