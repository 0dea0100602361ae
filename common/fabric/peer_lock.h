/* A post that would wait on a stopped or dead peer's lock is refused: -FI_EAGAIN.
 *
 * Before libfabric 1.18, shm puts a command into a peer's region under that region's
 * spin lock, taken with pthread_spin_lock (smr_generic_rma, prov/shm/src/smr_rma.c;
 * smr_generic_sendmsg and smr_generic_inject, smr_msg.c), and the peer's own progress
 * holds the same lock while it copies what a command brings (smr_progress_cmd,
 * smr_progress.c): most of a --delivery-complete client's time. A peer stopped
 * (SIGSTOP, Ctrl-Z) or killed while it holds it leaves our post spinning inside
 * fi_writemsg, until it is continued or forever: no deadline of ours can end that
 * call, only the watchdog, with the process (common/bounds.py). So each post to an shm
 * peer on those versions looks at the peer's lock first, through a read-only mapping of
 * its region of our own, and a lock held is the provider's "not now": the caller
 * retries, reads its CQ, and gives the peer up at its deadline as for any silent peer.
 * What it cannot see: a lock taken in the instant between this look and the provider's
 * (tests/test_project_crash_cases.py counts how rare: with 1.17 on a 2-core VM, of clients
 * stopped one after another, 0 in 83 hung the server alone and 1 in 45 beside two CPU hogs;
 * 10 in 36 without this look). From 1.18 shm's queue takes commands
 * without a lock, and this costs one test of a cached flag per post.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define PEER_LOCK_REGION_VERSION 4  /* SMR_VERSION of the layout below (include/ofi_shm.h) */
#define PEER_LOCK_CACHE 64          /* peers whose region stays mapped here, the latest met */
#define PEER_LOCK_NAME 64           /* SMR_NAME_MAX (include/ofi_shm.h) */

/* The head of 1.17's struct smr_region (include/ofi_shm.h), as a release build lays it
   out: a debug build's atomics are wider (ATOMIC_DEF_INIT, include/ofi_atom.h), which
   moves what follows `lock`; tut_own_requester_gone checks what it reads from there. */
struct peer_lock_region {
    uint8_t version, resv;
    uint16_t flags;
    int pid;
    uint8_t cma_cap_peer, cma_cap_self;
    uint32_t max_sar_buf_per_peer;
    void *base_addr;
    pthread_spinlock_t lock;
    int32_t signal;
    void *map;
    size_t total_size, cmd_cnt, sar_cnt;
    size_t cmd_queue_offset, resp_queue_offset, inject_pool_offset;
};

/* The head of 1.17's struct util_ep (include/ofi_util.h), which shm's endpoint begins with:
   the AV the endpoint is bound to, whose fi_av_lookup names a peer's region. */
struct peer_lock_util_ep {
    struct fid_ep ep_fid;
    void *domain;
    struct fid_av *av;
};

/* Per thread of each module of the binding (the workers post at once, and a lock of ours
   would be the very contention chapters 12-13 take away): regions mapped, by name. */
static __thread struct peer_lock_map {
    char name[PEER_LOCK_NAME];
    const struct peer_lock_region *region;  /* NULL: not one we can read */
    ino_t inode;
} peer_locks[PEER_LOCK_CACHE];
static __thread size_t peer_locks_next;

/* Whether posts on `ep` go through 1.x shm's locks: its fid ops, seen once per kind. */
static inline int peer_lock_applies(struct fid_ep *ep)
{
    static __thread int old = -1;
    static __thread struct fi_ops *shm, *other[4];
    if (old < 0)
        old = fi_version() < FI_VERSION(1, 18);
    if (!old || ep->fid.ops == other[0] || ep->fid.ops == other[1] ||
        ep->fid.ops == other[2] || ep->fid.ops == other[3])
        return 0;
    if (ep->fid.ops == shm)
        return 1;
    char name[PEER_LOCK_NAME + 16];
    size_t len = sizeof name;
    if (fi_getname(&ep->fid, name, &len) == 0 && !strncmp(name, "fi_shm://", 9)) {
        shm = ep->fid.ops;
        return 1;
    }
    for (size_t i = 0; i < 4; i++)
        if (!other[i]) {
            other[i] = ep->fid.ops;
            break;
        }
    return 0;
}

/* Map region `name` (read-only: we only look) into `m`. */
static inline void peer_lock_map(struct peer_lock_map *m, const char *name)
{
    struct stat st;
    if (m->region)
        munmap((void *)m->region, sizeof *m->region);
    strncpy(m->name, name, PEER_LOCK_NAME - 1);
    m->name[PEER_LOCK_NAME - 1] = '\0';
    m->region = NULL;
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0)
        return;  /* gone: the provider's own mapping will say so */
    void *p = fstat(fd, &st) || (size_t)st.st_size < sizeof *m->region ? MAP_FAILED
              : mmap(NULL, sizeof *m->region, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return;
    m->region = p;
    m->inode = st.st_ino;
    if (m->region->version != PEER_LOCK_REGION_VERSION) {
        munmap(p, sizeof *m->region);
        m->region = NULL;
    }
}

/* Whether the lock of the region named `name` is held now. A free lock is the value
   pthread_spin_init leaves (glibc's x86 lock: 1 free, 0 or less held). */
static inline int peer_lock_held_by_name(const char *name)
{
    static __thread int free_value = -1;
    if (free_value == -1) {
        pthread_spinlock_t probe;
        pthread_spin_init(&probe, PTHREAD_PROCESS_SHARED);
        free_value = *(volatile int *)&probe;
    }
    struct peer_lock_map *m = NULL;
    for (size_t i = 0; i < PEER_LOCK_CACHE && !m; i++)
        if (peer_locks[i].name[0] && !strcmp(peer_locks[i].name, name))
            m = &peer_locks[i];
    if (!m) {
        m = &peer_locks[peer_locks_next++ % PEER_LOCK_CACHE];
        peer_lock_map(m, name);
    }
    if (!m->region || *(volatile const int *)&m->region->lock == free_value)
        return 0;
    /* held: by this very region, not an older one of a process whose pid came back */
    char path[PEER_LOCK_NAME + 16];
    struct stat st;
    snprintf(path, sizeof path, "/dev/shm/%s", name);
    if (stat(path, &st) || st.st_ino != m->inode) {
        peer_lock_map(m, name);
        return m->region && *(volatile const int *)&m->region->lock != free_value;
    }
    return 1;
}

/* Whether a post on `ep` to `addr` would wait on the peer's lock, held now. */
static inline int tut_peer_locked(struct fid_ep *ep, fi_addr_t addr)
{
    if (!peer_lock_applies(ep))
        return 0;
    char name[PEER_LOCK_NAME + 16];
    size_t len = sizeof name;
    struct fid_av *av = ((struct peer_lock_util_ep *)ep)->av;
    if (!av || fi_av_lookup(av, addr, name, &len) || len > sizeof name)
        return 0;
    const char *bare = strstr(name, "://");  /* the region's name follows the prefix */
    return peer_lock_held_by_name(bare ? bare + 3 : name);
}

/* The name of `ep`'s own region, in `buf`, where posts on `ep` go through 1.x shm's
   locks; NULL elsewhere. */
static inline const char *peer_lock_own_name(struct fid_ep *ep, char *buf, size_t size)
{
    if (!peer_lock_applies(ep))
        return NULL;
    size_t len = size - 1;
    if (fi_getname(&ep->fid, buf, &len) || len >= size)
        return NULL;
    buf[len] = '\0';
    const char *bare = strstr(buf, "://");
    return bare ? bare + 3 : buf;
}

/* Whether the lock of `ep`'s own region is held now (1.x shm; 0 elsewhere). Our progress
   takes it (smr_progress_resp, smr_progress_cmd, smr_progress.c) in every fi_cq_read that
   finds the region signalled, and spins there while a peer holds it: a peer killed or
   stopped in a post to us (smr_generic_rma, smr_rma.c; smr_generic_sendmsg, smr_msg.c)
   holds it until it is continued, or forever. Read through the same kind of read-only
   mapping as a peer's, by the name fi_getname gives, as a peer would. */
static inline int tut_own_lock_held(struct fid_ep *ep)
{
    char name[PEER_LOCK_NAME + 16];
    const char *own = peer_lock_own_name(ep, name, sizeof name);
    return own && peer_lock_held_by_name(own);
}

/* 1.17's command queue in a region (OFI_DECLARE_CIRQUE, include/ofi_rbuf.h; struct
   smr_cmd, 256 bytes, include/ofi_shm.h) and what a connection request says in it. */
struct peer_lock_cmd_queue {
    size_t size, size_mask, rcnt, wcnt;
};
#define PEER_LOCK_CMD_SIZE 256       /* SMR_CMD_SIZE */
#define PEER_LOCK_CMD_OP 16          /* offsetof(struct smr_msg_hdr, op), a uint32_t */
#define PEER_LOCK_CMD_SRC_DATA 32    /* offsetof(struct smr_msg_hdr, src_data), a uint64_t */
#define PEER_LOCK_CONNREQ 256        /* SMR_OP_MAX + ofi_ctrl_connreq */
#define PEER_LOCK_RECHECK_NS 100000000L  /* how often our own region's mapping is checked */

/* Our own region, mapped whole and read-only, by name; looked at again (renewed at the
   same address, a new region has the same name) at most every PEER_LOCK_RECHECK_NS. */
static __thread struct {
    char name[PEER_LOCK_NAME];
    const char *base;
    size_t size;
    ino_t inode;
    long checked;  /* CLOCK_MONOTONIC, ns */
} own_region;

static inline const char *peer_lock_own_region(const char *name)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long ns = now.tv_sec * 1000000000L + now.tv_nsec;
    if (own_region.base && !strcmp(own_region.name, name) && own_region.checked &&
        ns - own_region.checked < PEER_LOCK_RECHECK_NS)
        return own_region.base;
    char path[PEER_LOCK_NAME + 16];
    struct stat st;
    snprintf(path, sizeof path, "/dev/shm/%s", name);
    if (own_region.base && !strcmp(own_region.name, name) && !stat(path, &st) &&
        st.st_ino == own_region.inode) {
        own_region.checked = ns;
        return own_region.base;
    }
    if (own_region.base)
        munmap((void *)own_region.base, own_region.size);
    own_region.base = NULL;
    strncpy(own_region.name, name, PEER_LOCK_NAME - 1);
    own_region.name[PEER_LOCK_NAME - 1] = '\0';
    own_region.checked = ns;
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0)
        return NULL;
    void *p = fstat(fd, &st) || (size_t)st.st_size < sizeof(struct peer_lock_region)
              ? MAP_FAILED : mmap(NULL, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return NULL;
    const struct peer_lock_region *head = p;
    if (head->version != PEER_LOCK_REGION_VERSION || head->total_size != (size_t)st.st_size) {
        munmap(p, st.st_size);  /* not 1.17's layout (another version, a debug build) */
        return NULL;
    }
    own_region.base = p;
    own_region.size = st.st_size;
    own_region.inode = st.st_ino;
    return own_region.base;
}

/* Whether the command queue of our region at `base` holds a connection request naming a
   region that is gone. The queue is read without the lock, as a peer's region is: a
   command below wcnt has been written whole (ofi_cirque_commit). */
static inline int peer_lock_requester_gone(const char *base)
{
    const struct peer_lock_region *head = (const void *)base;
    size_t size = own_region.size, at = head->cmd_queue_offset;
    if (at > size - sizeof(struct peer_lock_cmd_queue))
        return 0;
    const volatile struct peer_lock_cmd_queue *q = (const void *)(base + at);
    size_t qsize = q->size, rcnt = q->rcnt, wcnt = q->wcnt;
    if (rcnt == wcnt || !qsize || (qsize & (qsize - 1)) || q->size_mask != qsize - 1 ||
        wcnt - rcnt > qsize || at + sizeof *q + qsize * PEER_LOCK_CMD_SIZE > size)
        return 0;
    for (size_t i = rcnt; i != wcnt; i++) {
        const char *cmd = base + at + sizeof *q + (i & (qsize - 1)) * PEER_LOCK_CMD_SIZE;
        if (*(const volatile uint32_t *)(cmd + PEER_LOCK_CMD_OP) != PEER_LOCK_CONNREQ)
            continue;
        uint64_t src = *(const volatile uint64_t *)(cmd + PEER_LOCK_CMD_SRC_DATA);
        if (src > size - PEER_LOCK_NAME)
            continue;
        char peer[PEER_LOCK_NAME], path[PEER_LOCK_NAME + 16];
        memcpy(peer, base + src, PEER_LOCK_NAME);
        peer[PEER_LOCK_NAME - 1] = '\0';
        const char *bare = strstr(peer, "://");
        snprintf(path, sizeof path, "/dev/shm/%s", bare ? bare + 3 : peer);
        struct stat st;
        if (peer[0] && stat(path, &st) && errno == ENOENT)
            return 1;
    }
    return 0;
}

/* Whether a connection request in our own region's command queue names a region that is
   gone (1.x shm, SMR_VERSION 4: 0 elsewhere). A client's first post to us leaves one,
   naming its region, for our progress to map (smr_send_name, prov/shm/src/smr_ep.c); a
   client that ended meanwhile has removed that region, and our next fi_cq_read then fails
   to map it and reads through the NULL it got (smr_progress_connreq, smr_progress.c:
   1.17 does not check; 2.0 does). It happens where we read late: stopped (Ctrl-Z), or
   starved, while the client gave up. A request found is looked for again in the region
   now at our name: an endpoint opened again there has a new one. */
static inline int tut_own_requester_gone(struct fid_ep *ep)
{
    char name[PEER_LOCK_NAME + 16];
    const char *own = peer_lock_own_name(ep, name, sizeof name);
    const char *base = own ? peer_lock_own_region(own) : NULL;
    if (!base || !peer_lock_requester_gone(base))
        return 0;
    own_region.checked = 0;
    base = peer_lock_own_region(own);
    return base && peer_lock_requester_gone(base);
}

/* fi_sendmsg and fi_writemsg, refused while the peer's lock is held (tut_peer_locked). */
static inline ssize_t peer_sendmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags)
{
    return tut_peer_locked(ep, msg->addr) ? -FI_EAGAIN : fi_sendmsg(ep, msg, flags);
}

static inline ssize_t peer_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg,
                                    uint64_t flags)
{
    return tut_peer_locked(ep, msg->addr) ? -FI_EAGAIN : fi_writemsg(ep, msg, flags);
}
