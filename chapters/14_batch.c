/* cdef
struct counter {            // one worker's count of completed WRITEs, alone on its cache
    uint8_t before[64];     // line: the padding keeps every other variable off that line
    uint64_t value;
    uint8_t after[56];
};
int worker(struct lane *lanes, size_t nlanes, unsigned batch, uint64_t more,
           struct counter *done, int *stop, int *failed_lane);
*/
/* Chapter 14's worker: chapter 13's, posting up to `batch` WRITEs per visit.
 *
 * Until now a visit to a lane posted one WRITE, then read the CQ, then moved
 * on: every WRITE paid for a whole visit (a CQ read, the loop, the checks).
 * Now a visit posts up to `batch` (16 by default, as in the series), so that
 * cost is shared by many WRITEs, and each NIC gets work in bursts it can
 * pipeline.
 */
#include "engine/lane.h"

struct visit_args {
    unsigned batch;
    uint64_t more;  /* FI_MORE, or 0 where the provider may never send what it held */
    struct counter *done;
};

static ssize_t visit(struct lane *l, void *args)
{
    struct visit_args *a = args;
    struct counter *done = a->done;
    /* Up to `batch` new WRITEs and one doorbell for them: each but the last goes with
       FI_MORE ("more follow at once"), so the provider may hold them until the last,
       posted without it, rings the NIC (efa-direct does:
       prov/efa/src/efa_data_path_direct_entry.h). A batch left open may never be sent:
       submit_more() (engine/lane.h) closes each before the CQ is read, and batches only
       what the send queue has room for; FABRIC_RULES checks both. */
    ssize_t rc = submit_more(l, a->batch, a->more);
    if (rc == 0)
        rc = reap(l);
    if (rc > 0)  /* its only writer: a plain store the main thread may read */
        __atomic_store_n(&done->value, done->value + (uint64_t)rc, __ATOMIC_RELAXED);
    if (rc >= 0)  /* also with nothing completed: a refusal may be over */
        rc = drain(l, l->nslots);
    return rc;
}

int worker(struct lane *lanes, size_t nlanes, unsigned batch, uint64_t more,
           struct counter *done, int *stop, int *failed_lane)
{
    struct visit_args args = {batch, more, done};
    return run_lanes(lanes, nlanes, stop, failed_lane, visit, &args);
}
