"""The baseline for chapter 17: an all-to-all that NCCL moves (cupy.cuda.nccl)."""

import numpy as np

from common.gpu import rounding
from common.moe.bookkeeping import (Shape, Stages, Wire, check_shape, check_tokens,
                                    receive_plan, send_plan, weighted_sum)
from common.moe.memory import CudaMemory


class NcclAllToAll(Stages):
    """The baseline: the same job, the same interface, with NCCL (cupy.cuda.nccl) moving
    the bytes. It has to do all of it: count, pack, exchange the counts (an all-gather),
    send each peer its tokens (grouped send/recv of per-peer sizes), unpack expert-major;
    back for combine, then the weighted sum. GPU only, one GPU per rank (NCCL refuses two
    ranks on one GPU). Run on 2 x H200 (2 ranks)."""

    def __init__(self, own, group, max_tokens, experts, topk, hidden, dispatch_dtype,
                 combine_dtype="bf16"):
        check_shape(group.world, max_tokens, experts, topk, hidden, dispatch_dtype, 0,
                    combine_dtype)
        self.group = group
        self.L = Shape(group.world, experts, max_tokens, topk, hidden, dispatch_dtype)
        self.mem = mem = CudaMemory(own, group, 0)
        self.xp, self.wire, self.proxy = mem.xp, Wire(dispatch_dtype, hidden, mem), None
        from cupy.cuda import nccl  # cupy is needed here only
        self.nccl = nccl
        # the id is 128 chars (cupy 14 takes it as bytes; its values, signed or not, mod 256)
        uid = bytes(v % 256 for v in nccl.get_unique_id()) if group.rank == 0 else b""
        uid = group.allgather(uid)[0]
        self.comm = nccl.NcclCommunicator(group.world, uid, group.rank)
        # abort, not destroy: NCCL 2.28's destroy waited forever on both ranks when a check
        # raised mid-round (2 x H200); every operation of ours has completed by then anyway
        own.callback(self.comm.abort)

    def _exchange(self, send, send_sizes, recv, recv_sizes, row):
        """One grouped round of NCCL send/recv: send[i-th block] to each rank, and each
        rank's block into recv; sizes in rows of `row` bytes."""
        nccl, stream = self.nccl, self.mem.stream.ptr
        out_at = np.concatenate([[0], np.cumsum(send_sizes)]) * row
        in_at = np.concatenate([[0], np.cumsum(recv_sizes)]) * row
        nccl.groupStart()
        for peer in range(self.group.world):
            if send_sizes[peer]:
                self.comm.send(send.data.ptr + int(out_at[peer]), int(send_sizes[peer]) * row,
                               nccl.NCCL_UINT8, peer, stream)
            if recv_sizes[peer]:
                self.comm.recv(recv.data.ptr + int(in_at[peer]), int(recv_sizes[peer]) * row,
                               nccl.NCCL_UINT8, peer, stream)
        nccl.groupEnd()

    def dispatch_send(self, x, indices):
        L, xp = self.L, self.xp
        indices = check_tokens(xp, x, indices, L)
        self._stage("idle", "dispatch sent")
        self.order, counts = send_plan(xp, indices, L.experts)
        self.per_dest = counts.reshape(L.world, L.local).sum(axis=1)
        # kept in self: NCCL reads them on the stream after this returns
        self.packed = xp.ascontiguousarray(self.wire.encode(x)[self.order // L.topk])
        self.counts_out, every = xp.asarray(counts), xp.empty(L.world * L.experts, xp.int32)
        self.comm.allGather(self.counts_out.data.ptr, every.data.ptr, L.experts,
                            self.nccl.NCCL_INT32, self.mem.stream.ptr)
        self.matrix = every.get().reshape(L.world, L.experts)  # waits: sizes come from it
        self.from_each, gather, self.counts = receive_plan(self.matrix, self.group.rank,
                                                           L.local)
        self.received = xp.empty((int(self.from_each.sum()), L.row), xp.uint8)
        self._exchange(self.packed, self.per_dest, self.received, self.from_each, L.row)
        self.gather, self.n_tokens = xp.asarray(gather), len(indices)

    def dispatch_recv(self):
        self._stage("dispatch sent", "dispatched")
        tokens, scales = self.wire.split(self.received[self.gather])
        return tokens, scales, self.counts

    def combine_send(self, expert_out):
        L, xp = self.L, self.xp
        self._stage("dispatched", "combine sent")
        self.out = xp.empty((len(self.gather), L.hidden), xp.uint16)
        self.out[self.gather] = rounding.to_bf16(expert_out)
        self.back = xp.empty((self.n_tokens * L.topk, L.hidden), xp.uint16)
        self._exchange(self.out, self.from_each, self.back, self.per_dest, L.out_row)

    def combine_recv(self, weights):
        self._stage("combine sent", "idle")
        return weighted_sum(self.xp, self.back.view(self.xp.uint8), self.order, weights,
                            self.L.hidden)
