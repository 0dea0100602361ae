/* The binding's own C helpers (common/fabric/_build.py compiles them into common._fabric):
   what Python cannot do through cffi alone, or not fast enough. Included after libfabric's
   headers and rules.h. */
#ifndef TUT_HELPERS_H
#define TUT_HELPERS_H

/* fi_mr_attr grew unions and fields in 2.x; filling it in C keeps one
   Python code path for 1.17 and 2.x. With dmabuf_fd >= 0 the memory is given
   as a dmabuf (FI_MR_DMABUF, libfabric >= 1.20), `buf` lying dmabuf_offset
   bytes into it: the base address plus the offset is the registration's
   virtual address (man/fi_mr.3.md). Older headers: -FI_ENOSYS. */
static int tut_mr_reg(struct fid_domain *domain, void *buf, size_t len, uint64_t access,
                      uint64_t key, int iface, int device, uint64_t flags, int dmabuf_fd,
                      uint64_t dmabuf_offset, struct fid_mr **mr)
{
    struct iovec iov = { buf, len };
    struct fi_mr_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.mr_iov = &iov;
#ifdef FI_MR_DMABUF
    struct fi_mr_dmabuf dmabuf = { dmabuf_fd, dmabuf_offset, len,
                                   (char *)buf - dmabuf_offset };
    if (dmabuf_fd >= 0) {
        attr.dmabuf = &dmabuf;
        flags |= FI_MR_DMABUF;
    }
#else
    if (dmabuf_fd >= 0)
        return -FI_ENOSYS;
#endif
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = key;
    attr.iface = (enum fi_hmem_iface)iface;
    attr.device.cuda = device;
    return fi_mr_regattr(domain, &attr, flags, mr);
}

/* 1 when the headers we were built with know FI_MR_DMABUF. */
static int tut_has_dmabuf(void)
{
#ifdef FI_MR_DMABUF
    return 1;
#else
    return 0;
#endif
}

/* Wait for one completion carrying immediate data on each of n CQs: the
   receiving side of chapters 09+, run by one thread per GPU with the GIL
   released. Reading a CQ is also what makes shm copy the data in (the
   receiver moves it), so a Python loop here would cap the writer. CQ i's
   immediate goes to data[i], got[i] = 1. Returns 0 when all arrived, 1 when
   *stop was set, or < 0 for CQ *failed (-FI_EAVAIL: its error entry waits). */
static int tut_wait_data(struct fid_cq **cqs, size_t n, uint64_t *data, uint8_t *got, int *stop,
                         size_t *failed)
{
    size_t left = 0;
    for (size_t i = 0; i < n; i++)
        left += !got[i];
    while (left) {
        if (__atomic_load_n(stop, __ATOMIC_RELAXED))
            return 1;
        int seen = 0;
        for (size_t i = 0; i < n; i++) {
            struct fi_cq_data_entry entries[16];
            ssize_t k = got[i] ? 0 : fi_cq_read(cqs[i], entries, 16);
            if (k == -FI_EAGAIN)
                continue;
            if (k < 0) {
                *failed = i;
                return (int)k;
            }
            seen += (int)k;
            for (ssize_t j = 0; j < k; j++) {
                if (entries[j].flags & FI_REMOTE_CQ_DATA && !got[i]) {
                    data[i] = entries[j].data;
                    got[i] = 1;
                    left--;
                }
            }
        }
        if (!seen)
            sched_yield();  /* nothing yet: let a peer on the same core run */
    }
    return 0;
}

/* Keep efa off its own shared-memory path for peers on this host, so that a
   benchmark on one host measures the NIC (fi_endpoint.3: before fi_enable;
   prov/efa/src/rdm/efa_rdm_ep_fiops.c). The option came in libfabric 1.21;
   against older headers this says -FI_ENOSYS. */
static int tut_forbid_shm(struct fid_ep *ep)
{
#if FI_VERSION_GE(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), FI_VERSION(1, 21))
    bool permitted = false;
    return fi_setopt(&ep->fid, FI_OPT_ENDPOINT, FI_OPT_SHARED_MEMORY_PERMITTED, &permitted,
                     sizeof permitted);
#else
    (void)ep;
    return -FI_ENOSYS;
#endif
}

/* Make an efa endpoint for GPU memory, before fi_enable, refuse to move that memory any
   other way than by the device itself (GPUDirect RDMA). Unasked, efa's RDM fabric registers
   GPU memory its device cannot reach under a made-up key (prov/efa/src/rdm/efa_rdm_mr.c,
   efa_rdm_mr_reg_impl) and copies every transfer through host memory. Step 1,
   FI_HMEM_P2P_REQUIRED: refused where the device cannot reach GPU memory or
   FI_HMEM_P2P_DISABLED is set (efa_hmem.c, efa_hmem_validate_p2p_opt); efa-direct, which
   has no other way, takes it as it is (efa_ep.c, efa_ep_setopt). Chosen over
   FI_OPT_CUDA_API_PERMITTED false (also refused without P2P, rdm/efa_rdm_ep_fiops.c
   efa_rdm_ep_set_cuda_api_permitted), which 1.17's headers lack, and which also closes efa's
   shm path for the endpoint (efa_rdm_ep_update_shm) and its cudaMemcpy copies. Step 2, device
   RDMA on: refused with FI_EFA_USE_DEVICE_RDMA=0 or a device without RDMA read
   (efa_rdm_ep_set_use_device_rdma), where efa would emulate each WRITE with SENDs; the option
   came in 1.18 and takes callers of API >= 1.18 only, and below that efa offers no FI_HMEM
   without device RDMA (efa_user_info.c, efa_user_info_should_support_hmem). Returns 0, or
   the refusal with *step saying which. */
static int tut_require_gpudirect(struct fid_ep *ep, int *step)
{
    int p2p = FI_HMEM_P2P_REQUIRED;
    *step = 1;
    int rc = fi_setopt(&ep->fid, FI_OPT_ENDPOINT, FI_OPT_FI_HMEM_P2P, &p2p, sizeof p2p);
#if FI_VERSION_GE(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), FI_VERSION(1, 18))
    if (!rc) {
        bool rdma = true;
        *step = 2;
        rc = fi_setopt(&ep->fid, FI_OPT_ENDPOINT, FI_OPT_EFA_USE_DEVICE_RDMA, &rdma,
                       sizeof rdma);
    }
#endif
    return rc;
}

/* Link speed in bits/s, 0 when the provider does not say. */
static size_t tut_nic_speed(const struct fi_info *info)
{
    if (!info->nic || !info->nic->link_attr)
        return 0;
    return info->nic->link_attr->speed;
}

/* The link's MTU in bytes, 0 when the provider does not say (shm, tcp). */
static size_t tut_nic_mtu(const struct fi_info *info)
{
    if (!info->nic || !info->nic->link_attr)
        return 0;
    return info->nic->link_attr->mtu;
}

/* PCI address of the NIC ("0000:4f:00.0"); 0 when unknown. */
static int tut_nic_pci(const struct fi_info *info, char *buf, size_t len)
{
    const struct fi_bus_attr *bus = info->nic ? info->nic->bus_attr : NULL;
    if (!bus || bus->bus_type != FI_BUS_PCI)
        return 0;
    snprintf(buf, len, "%04x:%02x:%02x.%x", bus->attr.pci.domain_id, bus->attr.pci.bus_id,
             bus->attr.pci.device_id, bus->attr.pci.function_id);
    return 1;
}

#endif
