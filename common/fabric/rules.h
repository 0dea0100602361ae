/* Checks as EFA and verbs would check: FABRIC_RULES=efa, efa-direct or verbs, on shm and tcp.
 *
 * shm and tcp accept calls that an EFA device or a verbs NIC refuses, so code
 * that only ever ran on them may be wrong for the NICs that matter. This header
 * is included after libfabric's own in every module of our binding (common/_fabric
 * and each chapter's common/_nativeNN), and the macros at its end route the calls
 * that post, register and poll through the checks below, from Python and from the
 * C workers alike. Without FABRIC_RULES each check is one test of a cached flag,
 * then libfabric's own call. A broken rule returns RULES_BROKEN - rule (the call
 * does not happen); tut_rules_text() names it (common/fabric/rules.py, common/fabric/errors.py).
 *
 * What each rule stands for, in libfabric 2.1.0's sources:
 *   descriptors  FI_MR_LOCAL: the device reads every buffer through its registration
 *                (efa-direct: prov/efa/src/efa_prov_info.c sets it; verbs_info.c too).
 *   keys         FI_MR_PROV_KEY: the key is the device's (OFI_MR_BASIC_MAP in both).
 *                shm and tcp hand back the requested key, so fi_mr_key here returns
 *                it tagged; a WRITE whose key lacks the tag used one we asked for.
 *   SEND size    efa: at most the device MTU (efa_msg.c only asserts it); verbs;rxm
 *                splits large messages itself.
 *   immediates   4 bytes (efa_cq.h EFA_CQ_DATA_SIZE; verbs: ibv_send_wr's imm_data).
 *   rma_iov      one per WRITE (rma_iov_limit 1: efa_prov_info.c, verbs_info.c).
 *   CQ size      efa: the device CQ has exactly attr->size entries (efa_cq.h), so no
 *                more operations may be in flight than that; rxm's CQs overflow into
 *                a list (prov/util/src/util_cq.c).
 *                Counted with them, peers' WRITEs with an immediate not read yet: each
 *                takes an entry, and with mode 0 no posted receive (FI_RX_CQ_DATA); 2.6.0's
 *                efa-direct opens the device CQ at exactly the size asked (efa_cq.c
 *                efa_cq_open_ibv_cq) and neither fabric guards against its overrun
 *                (docs/efa_fabric_comparison.md, FI_RM_ENABLED). Seen as a CQ is read: all
 *                its entries are taken at once into a stash, then handed out in order.
 *   wait objects efa: by the libfabric loaded (tut_rules_wait): FI_WAIT_NONE only before
 *                2.5 (rdm/efa_rdm_cq.c: -FI_ENOSYS); from 2.5 FI_WAIT_UNSPEC, and FI_WAIT_FD
 *                with its shm path off (2.6.0's rdm/efa_rdm_cq.c, man/fi_efa.7.md).
 *   fabrics      an fi_info entry's twin of another fabric and address format for the
 *                same domain name (common/fabric/rules.py adds them) must not be opened.
 *   domains      verbs: an endpoint goes on a domain with the fi_info of that domain (2.6.0:
 *                rxm opens its connections' verbs endpoints on its core domain with the core
 *                info of the endpoint's fi_info, prov/rxm/src/rxm_ep.c rxm_open_core_res,
 *                rxm_conn.c rxm_open_conn, and prov/verbs/src/verbs_ep.c vrb_open_ep refuses
 *                another device's name with -FI_EINVAL: on a real NIC the first message
 *                fails, here the open). Virtual NICs differ by name as a host's NICs do
 *                (rules.py virtual_nics); the provider gets the name without the suffix.
 * efa-direct, efa's rules and what one work request per call demands (libfabric 2.6.0's
 * prov/efa; docs/efa_fabric_comparison.md):
 *   hints        mode FI_CONTEXT2, mr_mode FI_MR_LOCAL | FI_MR_ALLOCATED | FI_MR_PROV_KEY |
 *                FI_MR_VIRT_ADDR, and FI_MR_HMEM with FI_HMEM, or fi_getinfo lists no
 *                efa-direct entry (efa_prov_info.c, efa_user_info.c; 2.2 enforces the MR bits).
 *   contexts     FI_CONTEXT2: the provider writes the operation's state into its context
 *                (efa.h efa_fill_context), so every SEND, receive and WRITE has one.
 *   iovs         at most 2 buffers per SEND or WRITE (efa_msg.c, efa_rma.c: sge_list[2],
 *                the device's max_sq_sge); nothing splits or stages them.
 *   WRITE size   at most the device's max_rdma_size, about 1 GiB (efa_rma.c asserts it);
 *                efa's RDM fabric splits a larger one.
 *   immediates   efa's RDM fabric: a WRITE with an immediate of at most 1 GiB. It cuts a
 *   once         longer WRITE into 1 GiB segments (2.6.0: rdm/efa_rdm_ope.c
 *                efa_rdm_ope_post_remote_write, efa_env.c efa_write_segment_size) and puts
 *                the immediate on each (rdm/efa_rdm_pke.c efa_rdm_pke_write, an assert
 *                only): the target would count one WRITE several times.
 *   RMA inject   0 bytes only (efa_rma.c efa_rma_inject_write; efa_base_ep.c sets
 *                inject_rma_size to 0).
 *   send queue   a batch with FI_MORE fits the room in the send queue (tx_attr.size: the QP's
 *                max_send_wr, efa_base_ep.c): on the rdma-core path each post with FI_MORE
 *                returns 0 unchecked and the closing one's ibv_wr_complete refuses the whole
 *                batch when it does not fit, rolling back WRITEs already accepted
 *                (efa_data_path_ops.h efa_ibv_post_write); the direct path refuses at the
 *                post and rings those before it (efa_data_path_direct_entry.h). In flight is
 *                what the endpoint's transmit CQ has: its own when it has that CQ alone.
 *   AV           a WRITE's target has its initiator in its AV before the first WRITE
 *                (the device's limit: docs/efa_fabric_comparison.md); seen here where the
 *                WRITE's immediate arrives, at an endpoint whose AV is still empty. No
 *                more can be seen: the initiator's process has no view of the target's
 *                AV, the target's CQ no entry for a WRITE without immediate, and
 *                tcp;ofi_rxm names no initiator of one with (rxm_cq.c, FI_ADDR_NOTAVAIL).
 *                That the insert comes before the first WRITE is the protocol's to keep
 *                (09-15: common/engine/multinet.py, introduce).
 *   wait objects FI_WAIT_UNSPEC or FI_WAIT_FD for a blocking read from 2.3 (efa_cq.c,
 *                man/fi_efa.7.md), or none; before 2.3 none (tut_rules_wait).
 *   Not checked: a context twice in flight (each of ours comes from a free list), the
 *                order of WRITEs (efa-direct keeps none: ours wait for completions),
 *                and a receive per immediate (FI_RX_CQ_DATA, 2.4, where the device has no
 *                unsolicited write receive: we do not offer it, so efa-direct lists no
 *                FI_RMA entry there, efa_user_info.c).
 * Every rule set:
 *   FI_MORE      a batch posted with FI_MORE ("more to come at once": the provider may hold
 *                its doorbell, efa_data_path_direct_entry.h) is closed by a post without it
 *                before the CQ is read; a refused post closes it too (the provider must
 *                flush then: man/fi_rma.3.md).
 * Offsets instead of addresses (no FI_MR_VIRT_ADDR) need no check here: common/fabric/rules.py
 * leaves the bit out of the hints, and shm and tcp then really take offsets.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>
#include "peer_lock.h"  /* 1.x shm: no post waits on a stopped peer's lock */

enum { RULES_OFF, RULES_EFA, RULES_VERBS, RULES_EFA_DIRECT };
#define RULES_BROKEN (-0x4000)
enum { RULE_DESC = 1, RULE_DESC_RANGE, RULE_DESC_CLOSED, RULE_KEY, RULE_MTU, RULE_IMM,
       RULE_RMA_IOV, RULE_CQ_FULL, RULE_WAIT, RULE_TWIN, RULE_HINTS, RULE_CONTEXT, RULE_IOV,
       RULE_RMA_SIZE, RULE_RMA_INJECT, RULE_AV, RULE_WAIT_DIRECT, RULE_MORE };
#define RULES_EFA_MTU 8928  /* an EFA device's largest SEND, as issue 15 gives it (fi_info's
                               link mtu: ibv_port_attr.max_msg_sz, efa_prov_info.c) */
#define RULES_KEY_TAG 0x5EC0000000000000ULL  /* in the top 16 bits: shm/tcp keys are small */
#define RULES_KEY_MASK 0xFFFF000000000000ULL
#define RULES_TWIN "-twin"                    /* ends a twin's fabric name */
#define RULES_MAX_IOV 4
#define RULES_DIRECT_IOV 2            /* efa_msg.c, efa_rma.c: "efa device support up to 2 iov" */
#define RULES_DIRECT_RDMA (1ULL << 30) /* max_rdma_size, "~ 1 GB": efa_fabric_comparison.md */
enum { RULE_MORE_ROOM = 0x100 };      /* efa-direct's send queue (numbered apart from the list) */
enum { RULES_CQ = 0x52437121, RULES_EP = 0x52457021, RULES_MR = 0x524d7221,
       RULES_MR_CLOSED = 0x524d7230 };
/* numbered apart from the list above, which other rules extend */
enum { RULE_DOMAIN = 64, RULE_IMM_SEGMENTS };
enum { RULES_DOMAIN = 0x52446f21 };
#define RULES_VNIC "~vnic"  /* in a virtual NIC's domain name (common/fabric/rules.py VNIC) */

static inline const char *tut_rules_text(long rc)
{
    switch (RULES_BROKEN - rc) {
    case RULE_DESC: return "FI_MR_LOCAL: a buffer without a descriptor from fi_mr_desc";
    case RULE_DESC_RANGE: return "FI_MR_LOCAL: a buffer outside the registration of its "
                                 "descriptor";
    case RULE_DESC_CLOSED: return "FI_MR_LOCAL: the descriptor of a closed registration";
    case RULE_KEY: return "FI_MR_PROV_KEY: a WRITE with a key fi_mr_key did not return "
                          "(the requested one?)";
    case RULE_MTU: return "a SEND larger than the 8928-byte EFA MTU";
    case RULE_IMM: return "immediate data above 32 bits (cq_data_size 4)";
    case RULE_RMA_IOV: return "more than one rma_iov in a WRITE (rma_iov_limit 1)";
    case RULE_CQ_FULL: return "more operations in flight than the CQ has entries (peers' "
                              "immediates not read yet counted)";
    case RULE_WAIT: return "a CQ wait object this libfabric's EFA CQs refuse (efa-direct's "
                           "take FI_WAIT_UNSPEC and FI_WAIT_FD from 2.3, efa's from 2.5, FD "
                           "there only with FI_EFA_ENABLE_SHM_TRANSFER=0)";
    case RULE_TWIN: return "an fi_info entry of another fabric or address format for the "
                           "same domain (take the entry of the endpoint it goes with)";
    case RULE_HINTS: return "hints without mode FI_CONTEXT2 or mr_mode FI_MR_LOCAL, "
                            "FI_MR_ALLOCATED, FI_MR_PROV_KEY, FI_MR_VIRT_ADDR (FI_MR_HMEM with "
                            "FI_HMEM): efa-direct lists nothing for them";
    case RULE_CONTEXT: return "an operation without a context (FI_CONTEXT2: the provider keeps "
                              "its state there)";
    case RULE_IOV: return "more than 2 buffers in one SEND or WRITE (the device's max_sq_sge)";
    case RULE_RMA_SIZE: return "a WRITE larger than 1 GiB, the device's max_rdma_size";
    case RULE_RMA_INJECT: return "an injected WRITE of more than 0 bytes (efa-direct's "
                                 "inject_rma_size is 0)";
    case RULE_MORE_ROOM: return "a batch with FI_MORE past the send queue's room (in flight "
                                "+ batch > tx_attr.size): rdma-core would roll the whole "
                                "batch back, WRITEs already accepted included";
    case RULE_AV: return "a WRITE arrived at an endpoint whose AV has no peer in it (the "
                         "target must insert its initiator first)";
    case RULE_WAIT_DIRECT: return "a CQ wait object other than FI_WAIT_UNSPEC or FI_WAIT_FD";
    case RULE_IMM_SEGMENTS: return "a WRITE with an immediate larger than 1 GiB (efa's "
                                   "segment: the target gets the immediate once a segment)";
    case RULE_DOMAIN: return "an endpoint opened on a domain with the fi_info of another "
                             "domain (verbs refuses it: open it with its own NIC's entry)";
    case RULE_MORE: return "the CQ read with a batch left open: the last post of a batch "
                           "goes without FI_MORE, or the provider may never ring the doorbell";
    }
    return NULL;
}

/* efa, efa-direct, verbs or off: FABRIC_RULES, read once (common/fabric/rules.py has
   refused other values). */
static inline int tut_rules(void)
{
    static int mode = -1;
    if (mode < 0) {
        const char *env = getenv("FABRIC_RULES");
        mode = !env ? RULES_OFF : !strcmp(env, "efa") ? RULES_EFA
               : !strcmp(env, "efa-direct") ? RULES_EFA_DIRECT
               : !strcmp(env, "verbs") ? RULES_VERBS : RULES_OFF;
    }
    return mode;
}

static inline int rules_direct(void) { return tut_rules() == RULES_EFA_DIRECT; }

/* The rules both of efa's fabrics have: the device's MTU and CQ. */
static inline int rules_efa(void) { return tut_rules() == RULES_EFA || rules_direct(); }

/* efa-direct only: what fi_getinfo's hints must offer for it to list an entry. */
static inline long tut_rules_hints(const struct fi_info *hints)
{
    const uint64_t mr = FI_MR_LOCAL | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_VIRT_ADDR;
    if (!rules_direct() || !hints)
        return 0;
    uint64_t need = mr | (hints->caps & FI_HMEM ? FI_MR_HMEM : 0);
    uint64_t has = hints->domain_attr ? (uint64_t)hints->domain_attr->mr_mode : 0;
    return (hints->mode & FI_CONTEXT2) && (has & need) == need ? 0 : RULES_BROKEN - RULE_HINTS;
}

/* What the checks remember, hung on each object's fid.context (ours is always NULL):
   every module of the binding finds them there, whoever opened the object. */
struct rules_ep;
struct rules_cq { uint32_t magic; size_t size, in_flight; enum fi_cq_format format;
                  size_t open_batches; struct rules_ep *rx_ep;
                  /* efa: entries read ahead, `served` of `stashed` handed out, `peers` of
                     the rest peers' immediates (rules_cq_take) */
                  char *stash; size_t stashed, served, peers; };
/* shm keeps no context on an AV (prov/util/src/util_av.c), so an AV's record is in a table
   of the module that opened it (from Python: common/_fabric) */
struct rules_av { struct fid_av *av; size_t count; };
#define RULES_AVS 1024
static struct rules_av rules_avs[RULES_AVS];
/* open: a batch posted with FI_MORE and not closed yet, per direction (1 tx, 2 rx) */
struct rules_ep { uint32_t magic; struct rules_cq *tx, *rx; struct rules_av *av; int open;
                  size_t sq; /* its fi_info's tx_attr.size */
                  struct fi_info *real; };
/* a domain's name as it was opened (a virtual NIC's with its suffix), and the entry the
   provider got for it */
struct rules_domain { uint32_t magic; char *name; struct fi_info *real; };
struct rules_mr { uint32_t magic; void *desc; uintptr_t base; size_t len; };

/* The record of `av` in this module's table; with `add`, a new one if it has none (NULL
   when the table is full: that AV goes unchecked). */
static inline struct rules_av *rules_av_of(struct fid_av *av, int add)
{
    struct rules_av *empty = NULL;
    for (size_t i = 0; i < RULES_AVS; i++) {
        if (rules_avs[i].av == av)
            return &rules_avs[i];
        if (!empty && !rules_avs[i].av)
            empty = &rules_avs[i];
    }
    if (!add || !empty)
        return NULL;
    *empty = (struct rules_av){av, 0};
    return empty;
}

static inline void *rules_of(struct fid *fid, uint32_t magic)
{
    uint32_t *r = fid->context;
    return r && *r == magic ? r : NULL;
}

static inline int rules_twin(const struct fi_fabric_attr *attr)
{
    size_t n = attr->name ? strlen(attr->name) : 0, t = strlen(RULES_TWIN);
    return n > t && !strcmp(attr->name + n - t, RULES_TWIN);
}

static inline const char *rules_domain_name(const struct fi_info *info)
{
    return info->domain_attr && info->domain_attr->name ? info->domain_attr->name : "";
}

/* What the provider gets for `info`: NULL (itself), or in `*real` a copy whose domain name
   is without a virtual NIC's suffix, for the caller to free. */
static inline int rules_real(const struct fi_info *info, struct fi_info **real)
{
    char *vnic = strstr(rules_domain_name(info), RULES_VNIC);
    *real = NULL;
    if (!vnic)
        return 0;
    if (!(*real = fi_dupinfo(info)))
        return -FI_ENOMEM;
    (*real)->domain_attr->name[vnic - info->domain_attr->name] = '\0';
    return 0;
}

static inline void rules_domain_gone(struct rules_domain *d)
{
    fi_freeinfo(d->real);
    free(d->name);
    free(d);
}

/* The provider's descriptors for `count` buffers, from the ones fi_mr_desc gave us. */
static inline int rules_descs(const struct iovec *iov, void **desc, size_t count,
                              void **real)
{
    if (count > RULES_MAX_IOV)
        return -FI_EINVAL;
    for (size_t i = 0; i < count; i++) {
        struct rules_mr *mr = desc ? desc[i] : NULL;
        if (mr && mr->magic == RULES_MR_CLOSED)
            return RULES_BROKEN - RULE_DESC_CLOSED;
        if (!mr || mr->magic != RULES_MR)
            return RULES_BROKEN - RULE_DESC;
        uintptr_t at = (uintptr_t)iov[i].iov_base;
        if (at < mr->base || at + iov[i].iov_len > mr->base + mr->len)
            return RULES_BROKEN - RULE_DESC_RANGE;
        real[i] = mr->desc;
    }
    return 0;
}

/* efa: room on the endpoint's CQ for the completion of one more operation. */
static inline int rules_cq_room(struct fid_ep *ep, int tx)
{
    struct rules_ep *e = rules_of(&ep->fid, RULES_EP);
    struct rules_cq *cq = e ? (tx ? e->tx : e->rx) : NULL;
    if (rules_efa() && cq && cq->size &&
        __atomic_load_n(&cq->in_flight, __ATOMIC_RELAXED) + cq->peers >= cq->size)
        return RULES_BROKEN - RULE_CQ_FULL;
    return 0;
}

/* The provider answered a post (`rc`): a batch opens with FI_MORE, and closes with a post
   without it or a refusal, which the provider must flush (man/fi_rma.3.md). */
static inline void rules_batch(struct rules_ep *e, int tx, uint64_t flags, ssize_t rc)
{
    struct rules_cq *cq = tx ? e->tx : e->rx;
    int bit = tx ? 1 : 2, open = rc == 0 && (flags & FI_MORE);
    if (!cq || open == !!(e->open & bit))
        return;
    e->open ^= bit;
    if (open)
        __atomic_add_fetch(&cq->open_batches, 1, __ATOMIC_RELAXED);
    else
        __atomic_sub_fetch(&cq->open_batches, 1, __ATOMIC_RELAXED);
}

/* efa-direct: no room in the send queue for this post of a batch with FI_MORE (it has the
   flag, or closes a batch that had it). Refused, the post closes the batch as a refusal
   does, so that what reads the CQ next is told of this rule, not of a batch left open. */
static inline int rules_sq_full(struct fid_ep *ep, uint64_t flags)
{
    struct rules_ep *e = rules_of(&ep->fid, RULES_EP);
    if (!e || !e->tx || !e->sq || !(flags & FI_MORE || e->open & 1)
        || __atomic_load_n(&e->tx->in_flight, __ATOMIC_RELAXED) < e->sq)
        return 0;
    rules_batch(e, 1, flags, -FI_EAGAIN);
    return 1;
}

/* An operation went (rc 0): its completion will take an entry of the CQ. */
static inline ssize_t rules_count(struct fid_ep *ep, int tx, uint64_t flags, ssize_t rc)
{
    struct rules_ep *e = rules_of(&ep->fid, RULES_EP);
    struct rules_cq *cq = e ? (tx ? e->tx : e->rx) : NULL;
    if (e)
        rules_batch(e, tx, flags, rc);
    if (cq && rc == 0)
        __atomic_add_fetch(&cq->in_flight, 1, __ATOMIC_RELAXED);
    return rc;
}

static inline void rules_reaped(struct rules_cq *cq, size_t n)
{
    size_t now = __atomic_load_n(&cq->in_flight, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&cq->in_flight, n < now ? n : now, __ATOMIC_RELAXED);
}

enum { RULES_SEND, RULES_RECV, RULES_WRITE };

/* The rules every operation keeps (a WRITE's key and rma_iov aside); fills `real` with
   the provider's descriptors of its buffers. */
static inline int rules_operation(struct fid_ep *ep, int op, const struct iovec *iov,
                                  void **desc, size_t count, uint64_t flags, uint64_t data,
                                  void *context, void **real)
{
    size_t len = 0;
    for (size_t i = 0; i < count; i++)
        len += iov[i].iov_len;
    if (op == RULES_SEND && rules_efa() && len > RULES_EFA_MTU)
        return RULES_BROKEN - RULE_MTU;
    if (op != RULES_RECV && flags & FI_REMOTE_CQ_DATA && data >> 32)
        return RULES_BROKEN - RULE_IMM;
    if (rules_direct()) {
        if (!context)
            return RULES_BROKEN - RULE_CONTEXT;
        if (op != RULES_RECV && count > RULES_DIRECT_IOV)
            return RULES_BROKEN - RULE_IOV;
        if (op == RULES_WRITE && len > RULES_DIRECT_RDMA)
            return RULES_BROKEN - RULE_RMA_SIZE;
        if (op == RULES_WRITE && flags & FI_INJECT && len)
            return RULES_BROKEN - RULE_RMA_INJECT;
        if (op != RULES_RECV && rules_sq_full(ep, flags))
            return RULES_BROKEN - RULE_MORE_ROOM;
    }
    if (tut_rules() == RULES_EFA && op == RULES_WRITE && flags & FI_REMOTE_CQ_DATA
        && len > RULES_DIRECT_RDMA)
        return RULES_BROKEN - RULE_IMM_SEGMENTS;
    int rc = rules_descs(iov, desc, count, real);
    return rc ? rc : rules_cq_room(ep, op != RULES_RECV);
}

/* A SEND or a receive: checked, then posted with the provider's descriptors. */
typedef ssize_t rules_post_msg(struct fid_ep *, const struct fi_msg *, uint64_t);
static inline ssize_t rules_msg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags,
                                int op, rules_post_msg *post)
{
    void *desc[RULES_MAX_IOV];
    struct fi_msg copy = *msg;
    int rc = rules_operation(ep, op, msg->msg_iov, msg->desc, msg->iov_count, flags, msg->data,
                             msg->context, desc);
    if (rc)
        return rc;
    copy.desc = desc;
    return rules_count(ep, op == RULES_SEND, flags, post(ep, &copy, flags));
}

static inline ssize_t tut_sendmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags)
{
    return tut_rules() ? rules_msg(ep, msg, flags, RULES_SEND, peer_sendmsg)
                       : peer_sendmsg(ep, msg, flags);
}

static inline ssize_t tut_recvmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags)
{
    return tut_rules() ? rules_msg(ep, msg, flags, RULES_RECV, fi_recvmsg)
                       : fi_recvmsg(ep, msg, flags);
}

static inline ssize_t tut_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg,
                                   uint64_t flags)
{
    if (!tut_rules())
        return peer_writemsg(ep, msg, flags);
    void *desc[RULES_MAX_IOV];
    struct fi_msg_rma copy = *msg;
    struct fi_rma_iov rma;
    if (msg->rma_iov_count != 1)
        return RULES_BROKEN - RULE_RMA_IOV;
    if ((msg->rma_iov[0].key & RULES_KEY_MASK) != RULES_KEY_TAG)
        return RULES_BROKEN - RULE_KEY;
    int rc = rules_operation(ep, RULES_WRITE, msg->msg_iov, msg->desc, msg->iov_count, flags,
                             msg->data, msg->context, desc);
    if (rc)
        return rc;
    rma = msg->rma_iov[0];
    rma.key &= ~RULES_KEY_MASK;  /* the provider's own key again */
    copy.desc = desc;
    copy.rma_iov = &rma;
    return rules_count(ep, 1, flags, peer_writemsg(ep, &copy, flags));
}

/* An injected operation went or was refused: a post without FI_MORE, closing a batch. */
static inline ssize_t rules_injected(struct fid_ep *ep, ssize_t rc)
{
    struct rules_ep *e = tut_rules() ? rules_of(&ep->fid, RULES_EP) : NULL;
    if (e)
        rules_batch(e, 1, 0, rc);
    return rc;
}

static inline ssize_t tut_inject(struct fid_ep *ep, const void *buf, size_t len, fi_addr_t dest)
{
    if (rules_efa() && len > RULES_EFA_MTU)  /* no descriptor, no completion */
        return RULES_BROKEN - RULE_MTU;
    return rules_injected(ep, tut_peer_locked(ep, dest) ? -FI_EAGAIN
                                                        : fi_inject(ep, buf, len, dest));
}

/* An injected WRITE: no descriptor, no completion (so no CQ room), but a WRITE's key and
   immediate rules; `data` only with FI_REMOTE_CQ_DATA in `flags`. */
static inline ssize_t rules_inject_write(struct fid_ep *ep, const void *buf, size_t len,
                                         uint64_t data, fi_addr_t dest, uint64_t addr,
                                         uint64_t key, uint64_t flags)
{
    if (tut_rules()) {
        if ((key & RULES_KEY_MASK) != RULES_KEY_TAG)
            return RULES_BROKEN - RULE_KEY;
        if (flags & FI_REMOTE_CQ_DATA && data >> 32)
            return RULES_BROKEN - RULE_IMM;
        if (rules_direct() && len)
            return RULES_BROKEN - RULE_RMA_INJECT;
        key &= ~RULES_KEY_MASK;  /* the provider's own key again */
    }
    return rules_injected(ep, tut_peer_locked(ep, dest) ? -FI_EAGAIN
                          : flags & FI_REMOTE_CQ_DATA
                          ? fi_inject_writedata(ep, buf, len, data, dest, addr, key)
                          : fi_inject_write(ep, buf, len, dest, addr, key));
}

static inline ssize_t tut_inject_write(struct fid_ep *ep, const void *buf, size_t len,
                                       fi_addr_t dest, uint64_t addr, uint64_t key)
{
    return rules_inject_write(ep, buf, len, 0, dest, addr, key, 0);
}

static inline ssize_t tut_inject_writedata(struct fid_ep *ep, const void *buf, size_t len,
                                           uint64_t data, fi_addr_t dest, uint64_t addr,
                                           uint64_t key)
{
    return rules_inject_write(ep, buf, len, data, dest, addr, key, FI_REMOTE_CQ_DATA);
}

/* No batch of an endpoint of `r` left open with FI_MORE (0), or the rule broken. */
static inline int rules_closed(struct rules_cq *r)
{
    return r && __atomic_load_n(&r->open_batches, __ATOMIC_RELAXED) ? RULES_BROKEN - RULE_MORE
                                                                    : 0;
}

/* efa-direct: a peer's WRITE (its immediate) reached an endpoint that knows no peer. */
static inline int rules_unknown_initiator(struct rules_cq *r)
{
    struct rules_av *av = r->rx_ep ? r->rx_ep->av : NULL;
    return rules_direct() && av && !av->count;
}

static inline size_t rules_stride(const struct rules_cq *r)
{
    return r->format == FI_CQ_FORMAT_DATA ? sizeof(struct fi_cq_data_entry)
         : r->format == FI_CQ_FORMAT_TAGGED ? sizeof(struct fi_cq_tagged_entry)
         : r->format == FI_CQ_FORMAT_MSG ? sizeof(struct fi_cq_msg_entry) : 0;
}

/* Entry `i` of `buf` is a peer's WRITE with an immediate, not our operation's completion. */
static inline int rules_from_peer(const struct rules_cq *r, const void *buf, size_t i)
{
    size_t stride = rules_stride(r);
    uint64_t f = stride ? ((const struct fi_cq_msg_entry *)((const char *)buf + i * stride))->flags
                        : 0;
    return (f & FI_REMOTE_CQ_DATA) && !(f & FI_RECV);
}

/* efa: fi_cq_read through the stash. Once it is empty, every entry waiting (up to one more
   than the CQ holds) is read into it; the peers' among them, with our operations in flight,
   must fit the CQ. An error entry waits behind the stash: -FI_EAVAIL once it is empty. */
static inline ssize_t rules_cq_take(struct fid_cq *cq, struct rules_cq *r, void *buf,
                                    size_t count)
{
    size_t stride = rules_stride(r), cap = r->size + 1;
    if (!stride || !r->size)
        return fi_cq_read(cq, buf, count);
    if (r->served == r->stashed) {
        ssize_t n = 0;
        if (!r->stash && !(r->stash = malloc(cap * stride)))
            return -FI_ENOMEM;
        r->served = r->stashed = r->peers = 0;
        while (r->stashed < cap
               && (n = fi_cq_read(cq, r->stash + r->stashed * stride, cap - r->stashed)) > 0) {
            for (ssize_t i = 0; i < n; i++)
                r->peers += rules_from_peer(r, r->stash, r->stashed + i);
            r->stashed += n;
        }
        if (!r->stashed)
            return n;
    }
    if (__atomic_load_n(&r->in_flight, __ATOMIC_RELAXED) + r->peers > r->size)
        return RULES_BROKEN - RULE_CQ_FULL;
    size_t n = r->stashed - r->served < count ? r->stashed - r->served : count;
    memcpy(buf, r->stash + r->served * stride, n * stride);
    r->served += n;
    for (size_t i = 0; i < n; i++)
        r->peers -= rules_from_peer(r, buf, i);
    return n;
}

/* Entries read that were our operations' (not a peer's immediate) leave the CQ. */
static inline ssize_t tut_cq_read(struct fid_cq *cq, void *buf, size_t count)
{
    struct rules_cq *r = tut_rules() ? rules_of(&cq->fid, RULES_CQ) : NULL;
    int broken = rules_closed(r);
    if (broken)
        return broken;
    ssize_t n = r && rules_efa() ? rules_cq_take(cq, r, buf, count) : fi_cq_read(cq, buf, count);
    if (!r || n <= 0)
        return n;
    size_t ours = 0;
    for (ssize_t i = 0; i < n; i++) {
        int peers = rules_from_peer(r, buf, i);
        if (peers && rules_unknown_initiator(r))
            return RULES_BROKEN - RULE_AV;
        ours += !peers;
    }
    rules_reaped(r, ours);
    return n;
}

static inline ssize_t tut_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf,
                                     uint64_t flags)
{
    struct rules_cq *r = tut_rules() ? rules_of(&cq->fid, RULES_CQ) : NULL;
    int broken = rules_closed(r);
    if (broken)
        return broken;
    ssize_t n = fi_cq_readerr(cq, buf, flags);
    if (r && n > 0)
        rules_reaped(r, 1);
    return n;
}

/* Whether efa opens its shm path's domain, as prov/efa/src/efa_shm.c efa_shm_info_create
   decides by FI_EFA_ENABLE_SHM_TRANSFER (an int parameter, read by strtol: src/var.c). */
static inline int rules_efa_shm(void)
{
    const char *env = getenv("FI_EFA_ENABLE_SHM_TRANSFER");
    return !env || strtol(env, NULL, 0) != 0;
}

/* The wait objects an EFA CQ takes on libfabric `version` (fi_version() of the one loaded;
   a parameter so that tests/test_fabric_rules.py checks both sides of each line): 0, or
   the broken rule. Before 2.3 neither fabric takes one (2.1.0's efa_cq.c and
   rdm/efa_rdm_cq.c: -FI_ENOSYS); efa-direct takes FI_WAIT_UNSPEC and FI_WAIT_FD from 2.3
   (NEWS.md: "Support blocking cq read in efa-direct"; 2.6.0's efa_cq.c, efa_cq_open), efa
   from 2.5 ("Add blocking CQ read support for EFA protocol"; rdm/efa_rdm_cq.c
   efa_rdm_cq_configure_wait), and FI_WAIT_FD only without its shm path (`shm`), which has
   no fd to wait on; man/fi_efa.7.md says the same. */
static inline long tut_rules_wait(int rules, uint32_t version, int wait_obj, int shm)
{
    if (rules != RULES_EFA && rules != RULES_EFA_DIRECT)
        return 0;
    uint32_t since = rules == RULES_EFA ? FI_VERSION(2, 5) : FI_VERSION(2, 3);
    if (wait_obj == FI_WAIT_NONE)
        return 0;
    if (FI_VERSION_LT(version, since) || (rules == RULES_EFA && wait_obj == FI_WAIT_FD && shm))
        return RULES_BROKEN - RULE_WAIT;
    return wait_obj == FI_WAIT_UNSPEC || wait_obj == FI_WAIT_FD ? 0
           : RULES_BROKEN - RULE_WAIT_DIRECT;
}

static inline int tut_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr,
                              struct fid_cq **cq, void *context)
{
    if (!tut_rules())
        return fi_cq_open(domain, attr, cq, context);
    long broken = tut_rules_wait(tut_rules(), fi_version(), attr->wait_obj, rules_efa_shm());
    if (broken)
        return broken;
    struct rules_cq *r = calloc(1, sizeof *r);
    if (!r)
        return -FI_ENOMEM;
    *r = (struct rules_cq){RULES_CQ, attr->size, 0, attr->format, 0, NULL};
    int rc = fi_cq_open(domain, attr, cq, r);
    if (rc)
        free(r);
    return rc;
}

static inline int tut_endpoint(struct fid_domain *domain, struct fi_info *info,
                               struct fid_ep **ep, void *context)
{
    if (!tut_rules())
        return fi_endpoint(domain, info, ep, context);
    if (rules_twin(info->fabric_attr))
        return RULES_BROKEN - RULE_TWIN;
    struct rules_domain *d = rules_of(&domain->fid, RULES_DOMAIN);
    if (tut_rules() == RULES_VERBS && d && strcmp(d->name, rules_domain_name(info)))
        return RULES_BROKEN - RULE_DOMAIN;
    struct rules_ep *r = calloc(1, sizeof *r);
    if (!r)
        return -FI_ENOMEM;
    r->magic = RULES_EP;
    r->sq = info->tx_attr ? info->tx_attr->size : 0;
    int rc = rules_real(info, &r->real);
    if (!rc)
        rc = fi_endpoint(domain, r->real ? r->real : info, ep, r);
    if (rc) {
        fi_freeinfo(r->real);
        free(r);
    }
    return rc;
}

static inline int tut_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags)
{
    struct rules_ep *e = tut_rules() ? rules_of(&ep->fid, RULES_EP) : NULL;
    struct rules_cq *cq = e && bfid->fclass == FI_CLASS_CQ ? rules_of(bfid, RULES_CQ) : NULL;
    int rc = fi_ep_bind(ep, bfid, flags);
    if (e && !rc && bfid->fclass == FI_CLASS_AV)
        e->av = rules_av_of((struct fid_av *)bfid, 0);
    if (cq && !rc) {
        if (flags & FI_TRANSMIT)
            e->tx = cq;
        if (flags & FI_RECV) {
            e->rx = cq;
            cq->rx_ep = e;
        }
    }
    return rc;
}

/* An AV remembers how many peers it holds (efa-direct's AV rule). */
static inline int tut_av_open(struct fid_domain *domain, struct fi_av_attr *attr,
                              struct fid_av **av, void *context)
{
    int rc = fi_av_open(domain, attr, av, context);
    if (tut_rules() && !rc)
        rules_av_of(*av, 1);
    return rc;
}

static inline int tut_av_insert(struct fid_av *av, const void *addr, size_t count,
                                fi_addr_t *fi_addr, uint64_t flags, void *context)
{
    int rc = fi_av_insert(av, addr, count, fi_addr, flags, context);
    struct rules_av *r = tut_rules() && rc > 0 ? rules_av_of(av, 0) : NULL;
    if (r)
        r->count += (size_t)rc;
    return rc;
}

static inline int tut_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count,
                                uint64_t flags)
{
    int rc = fi_av_remove(av, fi_addr, count, flags);
    struct rules_av *r = tut_rules() && !rc ? rules_av_of(av, 0) : NULL;
    if (r)
        r->count -= count < r->count ? count : r->count;
    return rc;
}

static inline int tut_domain(struct fid_fabric *fabric, struct fi_info *info,
                             struct fid_domain **domain, void *context)
{
    if (!tut_rules())
        return fi_domain(fabric, info, domain, context);
    struct rules_domain *r = calloc(1, sizeof *r);
    if (!r || !(r->name = strdup(rules_domain_name(info)))) {
        free(r);
        return -FI_ENOMEM;
    }
    r->magic = RULES_DOMAIN;
    int rc = rules_real(info, &r->real);
    if (!rc)
        rc = fi_domain(fabric, r->real ? r->real : info, domain, r);
    if (rc)
        rules_domain_gone(r);
    return rc;
}

static inline int tut_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric,
                             void *context)
{
    if (tut_rules() && rules_twin(attr))
        return RULES_BROKEN - RULE_TWIN;
    return fi_fabric(attr, fabric, context);
}

/* What a registration covers: its iovec, or its dmabuf (the same union in fi_mr_attr). */
static inline struct iovec rules_range(const struct fi_mr_attr *attr, uint64_t flags)
{
#ifdef FI_MR_DMABUF
    if (flags & FI_MR_DMABUF)
        return (struct iovec){(char *)attr->dmabuf->base_addr + attr->dmabuf->offset,
                              attr->dmabuf->len};
#endif
    (void)flags;
    return attr->mr_iov[0];
}

static inline int tut_mr_regattr(struct fid_domain *domain, const struct fi_mr_attr *attr,
                                 uint64_t flags, struct fid_mr **mr)
{
    if (!tut_rules())
        return fi_mr_regattr(domain, attr, flags, mr);
    struct rules_mr *r = calloc(1, sizeof *r);
    if (!r)
        return -FI_ENOMEM;
    struct fi_mr_attr copy = *attr;
    copy.context = r;
    int rc = fi_mr_regattr(domain, &copy, flags, mr);
    if (rc) {
        free(r);
        return rc;
    }
    struct iovec range = rules_range(attr, flags);
    *r = (struct rules_mr){RULES_MR, fi_mr_desc(*mr), (uintptr_t)range.iov_base, range.iov_len};
    return 0;
}

static inline void *tut_mr_desc(struct fid_mr *mr)
{
    struct rules_mr *r = tut_rules() ? rules_of(&mr->fid, RULES_MR) : NULL;
    return r ? (void *)r : fi_mr_desc(mr);
}

static inline uint64_t tut_mr_key(struct fid_mr *mr)
{
    uint64_t key = fi_mr_key(mr);
    return tut_rules() && !(key & RULES_KEY_MASK) ? key | RULES_KEY_TAG : key;
}

/* A closed endpoint's open batches and its CQ's pointer to it go with it. */
static inline void rules_ep_gone(struct rules_ep *e)
{
    rules_batch(e, 1, 0, 0);
    rules_batch(e, 0, 0, 0);
    if (e->rx && e->rx->rx_ep == e)
        e->rx->rx_ep = NULL;
    fi_freeinfo(e->real);
    free(e);
}

/* A closed registration's record stays, marked: a descriptor used after it says so.
   An endpoint's and a CQ's go with them. */
static inline int tut_close(struct fid *fid)
{
    size_t fclass = fid->fclass;  /* read before the object is gone */
    void *r = !tut_rules() ? NULL : fclass == FI_CLASS_MR ? rules_of(fid, RULES_MR)
            : fclass == FI_CLASS_CQ ? rules_of(fid, RULES_CQ)
            : fclass == FI_CLASS_AV ? rules_av_of((struct fid_av *)fid, 0)
            : fclass == FI_CLASS_EP ? rules_of(fid, RULES_EP)
            : fclass == FI_CLASS_DOMAIN ? rules_of(fid, RULES_DOMAIN) : NULL;
    int rc = fi_close(fid);
    if (r && !rc) {
        if (fclass == FI_CLASS_MR)
            ((struct rules_mr *)r)->magic = RULES_MR_CLOSED;
        else if (fclass == FI_CLASS_EP)
            rules_ep_gone(r);
        else if (fclass == FI_CLASS_AV)
            ((struct rules_av *)r)->av = NULL;  /* its row is free again */
        else if (fclass == FI_CLASS_DOMAIN)
            rules_domain_gone(r);
        else {
            free(((struct rules_cq *)r)->stash);
            free(r);
        }
    }
    return rc;
}

#define fi_sendmsg tut_sendmsg
#define fi_recvmsg tut_recvmsg
#define fi_writemsg tut_writemsg
#define fi_inject tut_inject
#define fi_inject_write tut_inject_write
#define fi_inject_writedata tut_inject_writedata
#define fi_cq_read tut_cq_read
#define fi_cq_readerr tut_cq_readerr
#define fi_cq_open tut_cq_open
#define fi_endpoint tut_endpoint
#define fi_domain tut_domain
#define fi_ep_bind tut_ep_bind
#define fi_fabric tut_fabric
#define fi_mr_regattr tut_mr_regattr
#define fi_mr_desc tut_mr_desc
#define fi_mr_key tut_mr_key
#define fi_close tut_close
#define fi_av_open tut_av_open
#define fi_av_insert tut_av_insert
#define fi_av_remove tut_av_remove
