"""The transfer engine: what chapters 09-15 taught, as a library for chapters 18 and 19.

One Engine per GPU (or per process, for host memory): a domain, a data endpoint, a CQ and
an AV on each of the GPU's NICs (chapter 08's topology, as common/engine/nics.py chooses
them for a rank; virtual NICs, more domains of shm or tcp, where no NIC has a PCI address),
one C worker thread that owns their data path (common/transfer/worker.c, built as
common.transfer._native: lazy batched posting as in chapter 15, every NIC's CQ reaped,
immediates counted), pinned near the GPU (chapter 12), and a control endpoint for
SEND/RECV that Python drives (control.py).

    with fi.Closer() as own:
        eng = Engine(own, provider="shm")
        peer = eng.connect(their_address)            # bytes from eng.address() over there
        region = eng.register(array)                 # numpy, cupy or torch, no copy
        remote = eng.remote(their_descriptor)        # bytes from region.descriptor()
        eng.write_pages(peer, region, [0, 1], remote, [7, 3], 4096, imm=5).wait()
        # over there: eng.expect(5, 2, timeout)       # the 2 WRITEs with immediate 5 came
        layer = eng.prepare_pages(peer, region, [0, 1], remote, [7, 3], 4096)  # made once
        layer.write(imm=6, src_shift=2, dst_shift=2)  # pages 2, 3 to 9, 5; again and again

For a program of your own, README.md beside this file: how two processes swap addresses
and descriptors, what a region takes, each provider's range of immediates, what a closed
engine refuses; example.py runs two processes so (python -m common.transfer.example).

Python never touches a WRITE: it hands the worker a whole command (numpy arrays of
offsets) and waits with short sleeps; the worker writes back each command's progress and
the count of each immediate value that arrived, whatever the order and the NIC. Where a NIC
writes GPU memory that the GPU does not see in order, expect() flushes those writes
(cuFlushGPUDirectRDMAWrites) before it returns, so the GPU reads what arrived.

Between GPU memory of two processes on one host, a NIC is the wrong path: there a peer's
`route` is "cuda-ipc" (common/transfer/ipc.py: one kernel a command, straight into the
peer's memory, counted in the same arrival table), unless Engine(..., cuda_ipc=False).
Engine(..., peers=N): N engines may be writing into this one at once (chapter 19's trainers
into an inference rank), and each NIC's CQ has room for their WRITEs' immediates too.
With Engine(..., resident=True), a small prepared command there is not even a launch: a
kernel that stays on the GPU while commands come takes it from a queue in pinned memory
(ipc.cu's ipc_stand); Engine.rest() sends it off the GPU before the next.

The files: engine.py (Engine), commands.py (its WRITE calls, Prepared, Group),
transfers.py (a command in flight), regions.py (peers and regions), wire.py (the bytes of
an engine's address and a region's descriptor), control.py (the control endpoint), ipc.py
and ipc.cu (the CUDA IPC route), example.py (two processes), worker.c (the C worker; with
copier.c, built as common.transfer._native, whose ffi and lib a test imports from there).
This package re-exports the public names; a test that changes a global (IMM_TABLE, worker_cores)
patches the module that reads it (common.transfer.engine), as a copy here is not read.
"""
try:  # first: every module of the package imports it
    from common.transfer import _native  # noqa: F401
except ImportError as e:  # not built, or built before worker.c existed
    raise ImportError(f"the transfer engine's worker is not built ({e}): run "
                      "'.venv/bin/python common/_build_native.py'") from None
from common.transfer import ipc  # noqa: E402
from common.transfer.engine import Engine, inject_size  # noqa: E402
from common.transfer.transfers import PHASES, TransferError  # noqa: E402

__all__ = ["Engine", "PHASES", "TransferError", "inject_size", "ipc"]
