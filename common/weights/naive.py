"""The baseline of chapter 19, in the same run: the update the naive way, tensor by tensor,
as a broadcast from rank 0 would do it.
"""
import time

import numpy as np

from common.gpu import rounding
from common.gpu.layout import aligned
from common.weights import BARRIER, BLOCK, BROADCAST, FREE, GATHERED, imm, split
from common.weights.model import views


def fp8_bytes(p):
    """A whole fp8 tensor as the naive way sends it: codes, then its scales."""
    return aligned(p.rows * p.cols) + (p.rows // BLOCK) * (p.cols // BLOCK) * 4


def staging_at_least(plan):
    """Trainer 0's staging, at least: the largest fp8 tensor whole, quantised."""
    return max([fp8_bytes(p) for p in plan.params if p.fp8] + [0])


def add_gather(tr):
    """Trainer 0's buffer to gather a whole bf16 tensor in, registered as "gather"."""
    tr.gather = tr.ops.xp.zeros(max(p.rows * p.cols for p in tr.plan.params), tr.ops.xp.uint16)
    tr.regions["gather"] = tr.eng.register(tr.gather)


def inbox(plan, xp):
    """An inference rank's buffer for the largest whole tensor as the naive way sends it."""
    whole = max(2 * p.rows * p.cols for p in plan.params)  # bf16
    return xp.zeros(aligned(max([fp8_bytes(p) for p in plan.params if p.fp8] + [whole])),
                    xp.uint8)


def naive_trainer(tr, n, remote):
    """Trainer 0 gathers each tensor whole (the others WRITE their rows into it),
    quantises it, and WRITEs all of it to every inference rank; tensor by tensor, as a
    broadcast from rank 0 would. `remote`: every rank's regions. Returns its seconds."""
    eng, ops, plan, xp = tr.eng, tr.ops, tr.plan, tr.ops.xp
    gather = remote[0]["gather"] if tr.t else None
    inboxes = [r["inbox"] for r in remote[plan.trainers:]]
    largest, inference = eng.max_write, range(plan.trainers, plan.trainers + len(plan.layouts))
    start = time.perf_counter()
    for p in plan.params:
        t0, t1 = plan.rows[tr.t][p.index]
        if tr.t:
            if t0 < t1:
                post(eng, tr.peers[0], tr.regions["shard"], 2 * tr.shard_at[p.index], gather,
                     2 * t0 * p.cols, 2 * (t1 - t0) * p.cols, imm(n, GATHERED))
            eng.expect(imm(n, FREE), 1)
            continue
        whole = tr.gather[:p.rows * p.cols].reshape(p.rows, p.cols)
        whole[t0:t1] = tr.view(p)
        eng.expect(imm(n, GATHERED), sum(len(split("", 0, 2 * (u1 - u0) * p.cols, largest))
                                         for u0, u1 in (plan.rows[u][p.index]
                                                        for u in range(1, plan.trainers))
                                         if u0 < u1))
        if p.fp8:
            blocks = (p.rows // BLOCK) * (p.cols // BLOCK)
            ops.amax(whole, 0, tr.amax[:blocks])
            scales = rounding.fp8_scales(tr.amax[:blocks])
            ops.codes(whole, 0, scales, p.cols // BLOCK, 0, p.cols, tr.staging[:p.rows * p.cols])
            at = aligned(p.rows * p.cols) // 4
            tr.staging.view(xp.float32)[at:at + blocks] = scales
            source, length = tr.regions["staging"], fp8_bytes(p)
        else:
            source, length = tr.regions["gather"], 2 * p.rows * p.cols
        ops.sync()
        sent = [post(eng, tr.peers[r], source, 0, inboxes[r - plan.trainers], 0, length,
                     imm(n, BROADCAST)) for r in inference]
        for x in sent:
            x.wait()
        # every inference rank took its slices (not only "WRITEs completed": on shm with GPU
        # memory the target's copies may still be reading the gathered tensor)
        eng.expect(imm(n, FREE), len(inference))
        for u in range(1, plan.trainers):
            eng.signal(tr.peers[u], imm(n, FREE))
    eng.group(list(tr.peers.values())).barrier(imm(n, BARRIER))
    return time.perf_counter() - start


def naive_inference(inf, n, inbox):
    """Each whole tensor into the inbox, our slices copied out of it, then 'free'."""
    plan, ops, xp = inf.plan, inf.ops, inf.ops.xp
    mine = {}
    for tensor in inf.tensors:
        for piece in tensor.pieces:
            mine.setdefault(piece.source, []).append((tensor, piece))
    for p in plan.params:
        length = fp8_bytes(p) if p.fp8 else 2 * p.rows * p.cols
        inf.eng.expect(imm(n, BROADCAST), len(split("", 0, length, inf.eng.max_write)))
        if p.fp8:
            codes = inbox[:p.rows * p.cols].reshape(p.rows, p.cols)
            at = aligned(p.rows * p.cols)
            scales = inbox[at:at + fp8_bytes(p) - at].view(xp.float32).reshape(
                p.rows // BLOCK, p.cols // BLOCK)
        else:
            codes = inbox[:2 * p.rows * p.cols].view(xp.uint16).reshape(p.rows, p.cols)
        for tensor, piece in mine.get(p.name, ()):
            data, into = views(xp, inf.weights, tensor)
            at, height = piece.at_row, piece.row1 - piece.row0
            data[at:at + height] = codes[piece.row0:piece.row1, piece.col0:piece.col1]
            if p.fp8:
                b = at // BLOCK
                into[b:b + height // BLOCK] = scales[piece.row0 // BLOCK:piece.row1 // BLOCK,
                                                     piece.col0 // BLOCK:piece.col1 // BLOCK]
        ops.sync()
        inf.eng.signal(inf.peers[0], imm(n, FREE))
    inf.eng.group(list(inf.peers.values())).barrier(imm(n, BARRIER))


def post(eng, peer, region, src, remote, dst, length, value):
    """`length` bytes as WRITEs of at most the provider's largest, one command."""
    parts = np.array([(src + w.src, w.dst, w.length) for w in
                      split("", dst, length, eng.max_write)], np.uint64).T
    return eng.write_list(peer, region, parts[0], remote, parts[1], parts[2], value)
