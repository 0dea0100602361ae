"""Builds common._fabric, the cffi binding to libfabric (API mode, out-of-line).

API mode is not optional: libfabric exports only a handful of symbols, while
the data path (fi_writemsg, fi_cq_read, fi_mr_key, fi_allocinfo, ...) is
static inline in its headers, so the binding must be compiled against them.

libfabric is found through LIBFABRIC_PREFIX (e.g. /opt/amazon/efa, where the
AWS EFA installer puts it) or else through pkg-config.
"""
import os
import shlex
import subprocess
import sys

from cffi import FFI

CDEF = r"""
typedef uint64_t fi_addr_t;
struct iovec { void *iov_base; size_t iov_len; };
struct fid { size_t fclass; void *context; ...; };
typedef struct fid *fid_t;
struct fid_fabric { struct fid fid; ...; };
struct fid_domain { struct fid fid; ...; };
struct fid_ep { struct fid fid; ...; };
struct fid_cq { struct fid fid; ...; };
struct fid_av { struct fid fid; ...; };
struct fid_mr { struct fid fid; void *mem_desc; uint64_t key; ...; };
struct fi_device_attr { char *name; ...; };
enum fi_bus_type { FI_BUS_UNSPEC, FI_BUS_UNKNOWN, FI_BUS_PCI, ... };
struct fi_pci_attr { uint16_t domain_id; uint8_t bus_id; uint8_t device_id; uint8_t function_id; };
struct fi_bus_attr { enum fi_bus_type bus_type; union { struct fi_pci_attr pci; } attr; };
struct fi_link_attr { char *address; size_t mtu; size_t speed; ...; };
struct fid_nic { struct fid fid; struct fi_device_attr *device_attr; struct fi_bus_attr *bus_attr;
                 struct fi_link_attr *link_attr; void *prov_attr; };
struct fi_context2 { void *internal[8]; };

enum fi_ep_type { FI_EP_UNSPEC, FI_EP_MSG, FI_EP_DGRAM, FI_EP_RDM, ... };
enum fi_av_type { FI_AV_UNSPEC, FI_AV_MAP, FI_AV_TABLE, ... };
enum fi_cq_format { FI_CQ_FORMAT_UNSPEC, FI_CQ_FORMAT_CONTEXT, FI_CQ_FORMAT_MSG,
                    FI_CQ_FORMAT_DATA, FI_CQ_FORMAT_TAGGED, ... };
enum fi_wait_obj { FI_WAIT_NONE, FI_WAIT_UNSPEC, FI_WAIT_FD, FI_WAIT_MUTEX_COND, ... };
enum fi_hmem_iface { FI_HMEM_SYSTEM, FI_HMEM_CUDA, ... };
enum fi_type { FI_TYPE_INFO, FI_TYPE_EP_TYPE, FI_TYPE_CAPS, FI_TYPE_ADDR_FORMAT,
               FI_TYPE_MR_MODE, FI_TYPE_PROTOCOL, FI_TYPE_MODE, ... };

struct fi_tx_attr { uint64_t caps; size_t size; size_t iov_limit; size_t inject_size;
                    size_t rma_iov_limit; ...; };
struct fi_rx_attr { uint64_t caps; size_t size; size_t iov_limit; ...; };
struct fi_ep_attr { enum fi_ep_type type; uint32_t protocol; size_t max_msg_size; ...; };
struct fi_domain_attr { char *name; int mr_mode; size_t mr_key_size; size_t cq_data_size;
                        uint64_t mode; ...; };
struct fi_fabric_attr { char *name; char *prov_name; uint32_t prov_version;
                        uint32_t api_version; ...; };
struct fi_info {
    struct fi_info *next;
    uint64_t caps;
    uint64_t mode;
    uint32_t addr_format;
    size_t src_addrlen;
    size_t dest_addrlen;
    void *src_addr;
    void *dest_addr;
    fid_t handle;
    struct fi_tx_attr *tx_attr;
    struct fi_rx_attr *rx_attr;
    struct fi_ep_attr *ep_attr;
    struct fi_domain_attr *domain_attr;
    struct fi_fabric_attr *fabric_attr;
    struct fid_nic *nic;
};
struct fi_cq_attr { size_t size; uint64_t flags; enum fi_cq_format format;
                    enum fi_wait_obj wait_obj; ...; };
struct fi_av_attr { enum fi_av_type type; size_t count; ...; };
struct fi_cq_data_entry { void *op_context; uint64_t flags; size_t len; void *buf;
                          uint64_t data; };
struct fi_cq_err_entry { void *op_context; uint64_t flags; size_t len; void *buf;
                         uint64_t data; uint64_t tag; size_t olen; int err; int prov_errno;
                         void *err_data; size_t err_data_size; ...; };
struct fi_msg { const struct iovec *msg_iov; void **desc; size_t iov_count; fi_addr_t addr;
                void *context; uint64_t data; };
struct fi_rma_iov { uint64_t addr; size_t len; uint64_t key; };
struct fi_msg_rma { const struct iovec *msg_iov; void **desc; size_t iov_count; fi_addr_t addr;
                    const struct fi_rma_iov *rma_iov; size_t rma_iov_count; void *context;
                    uint64_t data; };

#define FI_MAJOR_VERSION ...
#define FI_MINOR_VERSION ...
#define FI_ADDR_UNSPEC ...
/* address formats */
#define FI_SOCKADDR_IN ...
#define FI_SOCKADDR_IN6 ...
#define FI_ADDR_STR ...
#define FI_SOCKADDR_IB ...
#define FI_ADDR_EFA ...

/* capabilities and operation flags */
#define FI_MSG ...
#define FI_RMA ...
#define FI_TAGGED ...
#define FI_ATOMIC ...
#define FI_MULTICAST ...
#define FI_COLLECTIVE ...
#define FI_READ ...
#define FI_WRITE ...
#define FI_RECV ...
#define FI_SEND ...
#define FI_REMOTE_READ ...
#define FI_REMOTE_WRITE ...
#define FI_MULTI_RECV ...
#define FI_REMOTE_CQ_DATA ...
#define FI_TRIGGER ...
#define FI_FENCE ...
#define FI_COMPLETION ...
#define FI_INJECT ...
#define FI_MORE ...
#define FI_DELIVERY_COMPLETE ...
#define FI_HMEM ...
#define FI_HMEM_DEVICE_ONLY ...
#define FI_RMA_EVENT ...
#define FI_SOURCE ...
#define FI_DIRECTED_RECV ...
#define FI_LOCAL_COMM ...
#define FI_REMOTE_COMM ...
#define FI_SHARED_AV ...
#define FI_NAMED_RX_CTX ...
/* fi_getinfo flags */
#define FI_PROV_ATTR_ONLY ...
/* modes */
#define FI_CONTEXT ...
#define FI_CONTEXT2 ...
#define FI_RX_CQ_DATA ...
/* memory registration modes */
#define FI_MR_LOCAL ...
#define FI_MR_RAW ...
#define FI_MR_VIRT_ADDR ...
#define FI_MR_ALLOCATED ...
#define FI_MR_PROV_KEY ...
#define FI_MR_MMU_NOTIFY ...
#define FI_MR_RMA_EVENT ...
#define FI_MR_ENDPOINT ...
#define FI_MR_HMEM ...
/* error numbers (returned negated) */
#define FI_EAGAIN ...
#define FI_EAVAIL ...
#define FI_EOTHER ...
#define FI_ENODATA ...
#define FI_ENOSYS ...
#define FI_EINVAL ...
#define FI_ENOMEM ...
#define FI_ETRUNC ...
#define FI_ECANCELED ...
#define FI_ENOPROTOOPT ...

uint32_t fi_version(void);
int fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
               const struct fi_info *hints, struct fi_info **info);
void fi_freeinfo(struct fi_info *info);
struct fi_info *fi_allocinfo(void);
struct fi_info *fi_dupinfo(const struct fi_info *info);
const char *fi_strerror(int errnum);
char *fi_tostr(const void *data, enum fi_type datatype);
int fi_close(struct fid *fid);

int fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
int fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain,
              void *context);
int fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep,
                void *context);
int fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq,
               void *context);
int fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av,
               void *context);
int fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int fi_enable(struct fid_ep *ep);
int fi_getname(struct fid *fid, void *addr, size_t *addrlen);
int fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr,
                 uint64_t flags, void *context);
int fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags);
uint64_t fi_mr_key(struct fid_mr *mr);
void *fi_mr_desc(struct fid_mr *mr);

ssize_t fi_sendmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags);
ssize_t fi_recvmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags);
ssize_t fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t fi_inject(struct fid_ep *ep, const void *buf, size_t len, fi_addr_t dest_addr);
ssize_t fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
const char *fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data,
                           char *buf, size_t len);

/* small C helpers for what differs between libfabric versions (see below) */
int tut_mr_reg(struct fid_domain *domain, void *buf, size_t len, uint64_t access,
               uint64_t key, int iface, int device, uint64_t flags, int dmabuf_fd,
               uint64_t dmabuf_offset, struct fid_mr **mr);
int tut_has_dmabuf(void);
int tut_forbid_shm(struct fid_ep *ep);
int tut_own_lock_held(struct fid_ep *ep);  /* peer_lock.h: 1.x shm, our own region */
int tut_own_requester_gone(struct fid_ep *ep);  /* peer_lock.h: 1.x shm, a gone client */
int tut_require_gpudirect(struct fid_ep *ep, int *step);
size_t tut_nic_speed(const struct fi_info *info);
size_t tut_nic_mtu(const struct fi_info *info);
int tut_nic_pci(const struct fi_info *info, char *buf, size_t len);
int tut_wait_data(struct fid_cq **cqs, size_t n, uint64_t *data, uint8_t *got, int *stop,
                  size_t *failed);
const char *tut_rules_text(long rc);  /* common/fabric/rules.h: the rule a call broke, or NULL */
long tut_rules_hints(const struct fi_info *hints);  /* rules.h: efa-direct's hints rule */
#define RULES_EFA ...
#define RULES_EFA_DIRECT ...
long tut_rules_wait(int rules, uint32_t version, int wait_obj, int shm);  /* rules.h */
char *strdup(const char *s);
void *malloc(size_t size);
void free(void *ptr);
"""

SOURCE = r"""
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_ext.h>  /* FI_OPT_EFA_USE_DEVICE_RDMA (from 1.18) */
#include "rules.h"  /* FABRIC_RULES=efa|efa-direct|verbs: every call checked as those NICs would */
#include "helpers.h"  /* the functions declared above: fi_mr_regattr by fields, CQ waits, NIC facts */
"""


def _flags():
    """Compiler and linker flags for the libfabric we build against."""
    prefix = os.environ.get("LIBFABRIC_PREFIX")
    if prefix:
        libdir = next((os.path.join(prefix, d) for d in ("lib64", "lib")
                       if os.path.exists(os.path.join(prefix, d, "libfabric.so"))), None)
        if not os.path.exists(os.path.join(prefix, "include", "rdma", "fabric.h")) or not libdir:
            sys.exit(f"LIBFABRIC_PREFIX={prefix}: no include/rdma/fabric.h and lib*/libfabric.so there")
        return dict(include_dirs=[os.path.join(prefix, "include")], library_dirs=[libdir],
                    runtime_library_dirs=[libdir], libraries=["fabric"])
    try:
        cflags = subprocess.run(["pkg-config", "--cflags", "libfabric"], check=True,
                                capture_output=True, text=True).stdout
        libs = subprocess.run(["pkg-config", "--libs", "libfabric"], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        sys.exit("libfabric not found: install it (Debian/Ubuntu: apt-get install libfabric-dev) "
                 "or set LIBFABRIC_PREFIX to its install prefix (AWS EFA: /opt/amazon/efa)")
    flags = shlex.split(cflags) + shlex.split(libs)
    return dict(include_dirs=[f[2:] for f in flags if f.startswith("-I")],
                library_dirs=[f[2:] for f in flags if f.startswith("-L")],
                runtime_library_dirs=[f[2:] for f in flags if f.startswith("-L")],
                libraries=[f[2:] for f in flags if f.startswith("-l")] or ["fabric"])


ffibuilder = FFI()
ffibuilder.cdef(CDEF)
HERE = os.path.dirname(os.path.abspath(__file__))
_fabric_flags = _flags()
_fabric_flags["include_dirs"] = _fabric_flags.get("include_dirs", []) + [HERE]  # rules.h, helpers.h
ffibuilder.set_source("common._fabric", SOURCE, **_fabric_flags)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
