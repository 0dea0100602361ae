"""A rank of the transfer engine's tests (tests/test_transfer_engine.py), started by scripts/launch.py.

    .venv/bin/python scripts/launch.py -n 2 tests/programs/transfer_ranks.py pair -p shm --nics 2
    .venv/bin/python scripts/launch.py -n 4 tests/programs/transfer_ranks.py group -p tcp
    .venv/bin/python scripts/launch.py -n 2 tests/programs/transfer_ranks.py kill -p shm [--watch]
    .venv/bin/python scripts/launch.py -n 2 tests/programs/transfer_ranks.py interrupt -p tcp
    .venv/bin/python scripts/launch.py -n 2 tests/programs/transfer_ranks.py torch --gpu 0
    .venv/bin/python scripts/launch.py -n 2 tests/programs/transfer_ranks.py pair --gpu 0 [--no-cuda-ipc]

Addresses and region descriptors travel through launch.Group.allgather. Every check
prints a line the test reads ("wrong bytes: N", "expected ...", "survivor: ...", and with
--gpu each peer's "route: ..."). With --gpu, pair, group and kill keep their regions in
that GPU's memory (cupy), the source seeded on the host and copied there.
"""
import argparse
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import common.fabric as fi
from common import bounds
from common import launch
from common.launch.rendezvous import _pack_list, _unpack_list
from common.transfer import Engine

PAGE = 4096


def seeded(seed, size):
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def on(args, array):
    """`array` where the ranks keep their regions: host memory, or GPU args.gpu's."""
    if args.gpu is None:
        return array
    from common.fabric import memory
    return memory.cupy().asarray(array)


def host(array):
    """A region's bytes on the host, to be checked (synchronized: what arrived is there)."""
    return array.get() if hasattr(array, "get") else array


def say_route(peer):
    print(f"route to peer {peer.index}: {peer.route} ({peer.why})", flush=True)


def pair(eng, group, args):
    """Rank 0 writes into rank 1: one WRITE, paged WRITEs, immediates interleaved."""
    me, other = group.rank, 1 - group.rank
    addresses = group.allgather(eng.address())
    peer = eng.connect(addresses[other])
    say_route(peer)
    pages = 256
    src = on(args, seeded([1, me], pages * PAGE))
    dst, single = (on(args, np.zeros(n, np.uint8)) for n in (pages * PAGE, 20000))
    regions = [eng.register(src), eng.register(dst), eng.register(single)]
    theirs = [eng.remote(d) for d in group.allgather(regions[1].descriptor())]
    singles = [eng.remote(d) for d in group.allgather(regions[2].descriptor())]
    timeout = args.timeout
    rng = np.random.default_rng(7)
    order = rng.permutation(pages)  # where page i of src lands: page order[i] of dst
    batches = [(10, range(0, 5)), (11, range(5, 12)), (12, range(12, 15)), (10, range(15, 19)),
               (13, range(19, 219)), (11, range(219, 256))]
    if me == 0:
        eng.write(peer, regions[0], 100, singles[other], 12345, 5000, imm=1).wait(timeout)
        transfers = [eng.write_pages(peer, regions[0], list(p), theirs[other], order[list(p)],
                                     PAGE, imm=imm) for imm, p in batches]
        for t in transfers:
            t.wait(timeout)
        print(f"wrote {sum(t.count for t in transfers) + 1} WRITEs; stats {eng.stats()}",
              flush=True)
        _, text = eng.recv(timeout)  # rank 1's verdict, as a control message
        peer_of, _ = eng.recv(timeout)  # from an engine this one never connected
        print(f"control: {text.decode()}; unknown sender -> {peer_of}", flush=True)
        eng.send(peer, b"bye")
    else:
        eng.expect(1, 1, timeout)
        got = host(single)  # bytes 12345.. from 100..: neither 16-byte aligned
        wrong = int(np.count_nonzero(got[12345:12345 + 5000] != seeded([1, 0], pages * PAGE)[100:5100]))
        wrong += int(np.count_nonzero(got[:12345])) + int(np.count_nonzero(got[17345:]))
        print(f"single WRITE: wrong bytes: {wrong}", flush=True)
        # other order than they were written: 12, then 11 (two batches), 13, 10 (two)
        for imm, n in ((12, 3), (11, 7 + 37), (13, 200), (10, 5 + 4)):
            eng.expect(imm, n, timeout)
            print(f"expected {n} WRITEs with immediate {imm}", flush=True)
        try:
            eng.expect(10, 1, 0.2)
        except TimeoutError as e:
            print(f"again: {e}", flush=True)
        source = seeded([1, 0], pages * PAGE).reshape(pages, PAGE)
        wrong = int(np.count_nonzero(host(dst).reshape(pages, PAGE)[order] != source))
        print(f"paged WRITEs: {pages} pages: wrong bytes: {wrong}", flush=True)
        eng.send(peer, f"rank 1 saw {wrong} wrong bytes".encode())
        with fi.Closer() as own:  # an engine rank 0 has not connected to
            stranger = Engine(own, provider=args.provider, nics=args.nics, timeout=timeout)
            stranger.send(stranger.connect(addresses[0]), b"hi")
        print(f"control reply: {eng.recv(timeout)[1].decode()}", flush=True)


def groups(eng, group, args):
    """Every rank scatters a slice to every rank (itself too), then barriers."""
    world, me = group.world, group.rank
    peers = [eng.connect(a) for a in group.allgather(eng.address())]
    for peer in peers:
        say_route(peer)
    length = args.length
    src = on(args, seeded([2, me], world * length))
    inboxes = [on(args, np.zeros(length, np.uint8)) for _ in range(world)]  # from rank r
    regions = [eng.register(src)] + [eng.register(box) for box in inboxes]
    descriptors = [_unpack_list(d) for d in
                   group.allgather(_pack_list([r.descriptor() for r in regions[1:]]))]
    # member i's inbox for what this rank sends
    dsts = [eng.remote(descriptors[i][me]) for i in range(world)]
    g = eng.group(peers)
    timeout = args.timeout
    t = g.scatter(regions[0], dsts, length, imm=20)
    eng.expect(20, world, timeout)
    t.wait(timeout)
    wrong = sum(int(np.count_nonzero(host(inboxes[r]) != seeded([2, r], world * length)
                                     [me * length:(me + 1) * length])) for r in range(world))
    print(f"scatter of {length} bytes from {world} ranks: wrong bytes: {wrong}", flush=True)
    for round_ in range(3):
        g.barrier(30 + round_, timeout)
    print(f"barriers: 3 passed; stats {eng.stats()}", flush=True)
    group.barrier()


def kill(eng, group, args):
    """Rank 1 checks rank 0's first round of pages, then dies (SIGKILL) while rank 0 writes
    more; rank 0 must see it. The ranks meet between the two: on libfabric 2.x, shm's
    target takes in queued WRITEs inside fi_cq_read until its queue is empty, so while a
    writer keeps it full, arrivals are counted only once the writer stops (README, "Using
    another libfabric")."""
    me, other = group.rank, 1 - group.rank
    peer = eng.connect(group.allgather(eng.address())[other])
    say_route(peer)
    pages = 2048
    buf = on(args, np.zeros(pages * PAGE, np.uint8))
    region = eng.register(buf)
    theirs = eng.remote(group.allgather(region.descriptor())[other])
    timeout = args.timeout
    if args.watch:
        eng.watch(group.check)
    if me == 1:
        eng.expect(5, pages, timeout)
        print("got the first round; dying", flush=True)
        group.barrier()
        os.kill(os.getpid(), signal.SIGKILL)

    piece = 128  # with --resident: small prepared commands, which the resident kernel takes
    prepared = (eng.prepare_pages(peer, region, range(piece), theirs, range(piece), PAGE)
                if args.resident else None)

    def write_round():
        if not args.resident:
            eng.write_pages(peer, region, range(pages), theirs, range(pages), PAGE,
                            imm=5).wait(timeout)
            return
        sent = [prepared.write(imm=5, src_shift=k, dst_shift=k) for k in range(0, pages, piece)]
        for t in sent:
            t.wait(timeout)
    write_round()
    group.barrier()  # rank 1 has the first round: from now on it may be gone at any time
    started = time.monotonic()
    try:
        for round_ in range(1, 10 ** 6):
            write_round()
    except Exception as e:  # what the survivor says: one line
        print(f"survivor: after {time.monotonic() - started:.1f} s, round {round_}: "
              f"{type(e).__name__}: {e}", flush=True)
        print(f"resident commands: {eng.stats()['resident_commands']}", flush=True)
        sys.exit(1)


def interrupt(eng, group, args):
    """Rank 0 WRITEs pages of 8 MiB to rank 1 without a pause; a second in, rank 1 gets a
    SIGINT (a Ctrl-C), and must end by its KeyboardInterrupt: closing an endpoint that a
    WRITE is arriving on crashed 1.17's tcp (common/fabric/calls.py, _left_open)."""
    me, other = group.rank, 1 - group.rank
    peer = eng.connect(group.allgather(eng.address())[other])
    size, pages = 8 << 20, 4
    region = eng.register(np.zeros(pages * size, np.uint8))
    theirs = eng.remote(group.allgather(region.descriptor())[other])
    group.barrier()
    if me == 1:
        time.sleep(1)
        print("interrupting myself", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(args.timeout)  # the KeyboardInterrupt comes first
        return
    try:
        while True:
            eng.write_pages(peer, region, range(pages), theirs, range(pages), size,
                            imm=6).wait(args.timeout)
    except Exception as e:  # rank 1 is gone: one line
        print(f"writer: {type(e).__name__}", flush=True)
        sys.exit(1)


def torch_pages(eng, group, args):
    """Rank 0 writes pages of a torch CUDA tensor into rank 1's (GPU memory moves between
    processes: shm maps it by CUDA IPC, which a process cannot do on its own memory);
    each rank says where its worker runs against its GPU's local cores (sysfs)."""
    import torch
    from common.engine import topo
    me, page = group.rank, 64 << 10
    peer = eng.connect(group.allgather(eng.address())[1 - me])
    src = (torch.arange(4 * page, device=f"cuda:{args.gpu}") * (me + 3)).to(torch.uint8)
    dst = torch.zeros(4 * page, dtype=torch.uint8, device=f"cuda:{args.gpu}")
    region, into = eng.register(src), eng.register(dst)
    theirs = eng.remote(group.allgather(into.descriptor())[1 - me])
    print(f"torch: registered without a copy: {region.ptr == src.data_ptr()}", flush=True)
    if me == 0:
        eng.write_pages(peer, region, [3, 0, 1], theirs, [0, 1, 2], page, imm=4).wait()
    else:
        eng.expect(4, 3)
        torch.cuda.synchronize()
        sent = (torch.arange(4 * page, device=dst.device) * 3).to(torch.uint8)
        want = torch.cat([sent[3 * page:], sent[:2 * page]])
        wrong = int((dst[:3 * page] != want).sum()) + int(dst[3 * page:].count_nonzero())
        print(f"torch: paged WRITEs: wrong bytes: {wrong}", flush=True)
    bus = topo.gpus_here()[0][args.gpu].lower()
    near = Path(f"/sys/bus/pci/devices/{bus}/local_cpulist")
    cores = set(topo.cpulist(near.read_text())) if near.exists() else os.sched_getaffinity(0)
    pinned = os.sched_getaffinity(eng._thread.native_id)
    print(f"worker on {len(pinned)} of the GPU's {len(cores)} local cores: "
          f"{pinned <= cores}", flush=True)
    group.allgather(b"done")  # the WRITE's source stays registered until rank 1 has checked


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["pair", "group", "kill", "interrupt", "torch"])
    p.add_argument("-p", "--provider", default="shm")
    p.add_argument("--nics", type=int, default=1)
    p.add_argument("--spread", default="round-robin")
    p.add_argument("--length", type=int, default=3000)
    # seconds as granted by the test (tests/support/budget.py), not stretched again here: the test
    # read the load once, and stops the launch when its own time is up
    p.add_argument("--timeout", type=float, default=10.0, help="for each transfer")
    p.add_argument("--join", type=float, default=60.0, help="for the ranks to meet")
    p.add_argument("--watch", action="store_true")
    p.add_argument("--gpu", type=int, default=None)
    p.add_argument("--no-cuda-ipc", action="store_true", help="GPU pages by libfabric only")
    p.add_argument("--resident", action="store_true", help="Engine(resident=True)")
    args = p.parse_args()
    bounds.watch()
    with launch.Group(launch.place_from_environment(), timeout=args.join) as group, \
            fi.Closer() as own:
        eng = Engine(own, provider=args.provider, gpu=args.gpu, nics=args.nics,
                     spread=args.spread, timeout=args.timeout, cuda_ipc=not args.no_cuda_ipc,
                     resident=args.resident)
        print(f"engine: {eng.provider}, {eng.nics}, {args.spread}", flush=True)
        modes = {"pair": pair, "group": groups, "kill": kill, "interrupt": interrupt,
                 "torch": torch_pages}
        modes[args.mode](eng, group, args)


if __name__ == "__main__":
    main()
