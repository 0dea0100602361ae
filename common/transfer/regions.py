"""The ends of a transfer engine's WRITE: a Peer (another engine, connected), a Region
(our memory, registered on every NIC's domain) and a RemoteRegion (a peer's, from its
descriptor)."""
import numpy as np

from common.transfer import wire
from common.transfer._native import ffi as _ffi

SIGNAL = 8             # bytes of the signal region a barrier writes into


class Peer:
    """Another engine, connected: its address in each of our NICs' AVs."""

    def __init__(self, index, ident, addrs, signal, control):
        self.index, self.id = index, ident
        self.addr = addrs        # fi_addr_t[nics]: its NIC i in our NIC i's AV
        self.signal = signal     # its signal region (a RemoteRegion)
        self.control = control   # its control endpoint in our control AV
        self.ipc = None          # an ipc.Route where GPU pages go by CUDA IPC
        self.route = "libfabric"  # or "cuda-ipc": how pages between GPU memory go ...
        self.why = "host memory"  # ... and why

    def __repr__(self):
        return f"Peer({self.index})"


class Region:
    """Memory registered on every NIC's domain, as a WRITE's source and target."""

    def __init__(self, engine, ptr, size, descs, bases, keys, gpu=None, ipc_handle=b""):
        self.engine, self.ptr, self.size, self.gpu = engine, ptr, size, gpu
        self.descs = _ffi.new("void *[]", descs)
        self.bases, self.keys = bases, keys
        self.ipc_handle = ipc_handle  # wire.HANDLE, for GPU memory CUDA can share

    def descriptor(self):
        """Everything a peer needs to WRITE into this region: address, size, per NIC
        (remote base, key), and for GPU memory its CUDA IPC handle. Send it (a control
        message, an allgather)."""
        return wire.pack_region(self.ptr, self.size, self.bases, self.keys, self.ipc_handle)


class RemoteRegion:
    """A peer's region, from its descriptor."""

    def __init__(self, ptr, size, bases, keys, ipc_handle=None):
        self.ptr, self.size = ptr, size
        self.bases = _ffi.new("uint64_t[]", bases)
        self.keys = _ffi.new("uint64_t[]", keys)
        self.ipc = ipc_handle  # (handle, offset, pid) where CUDA IPC can map it


def buffer_of(array):
    """(address, bytes, GPU or None) of a numpy, cupy or torch array, which must be
    contiguous (a registration is one range)."""
    if isinstance(array, np.ndarray):
        if array.dtype.hasobject:  # a peer's WRITE would overwrite the pointers
            raise ValueError("cannot register an array of Python objects (dtype object): its "
                             "bytes are pointers, not data")
        if not array.flags.c_contiguous:
            raise ValueError("the array must be contiguous")
        return array.ctypes.data, array.nbytes, None
    if hasattr(array, "data_ptr") and hasattr(array, "is_contiguous"):  # torch
        if not array.is_contiguous():
            raise ValueError("the tensor must be contiguous")
        gpu = array.device.index if array.is_cuda else None
        return array.data_ptr(), array.numel() * array.element_size(), gpu
    if hasattr(array, "data") and hasattr(array, "device") and hasattr(array.data, "ptr"):
        if not array.flags.c_contiguous:  # cupy
            raise ValueError("the array must be contiguous")
        return array.data.ptr, array.nbytes, array.device.id
    raise ValueError(f"cannot register a {type(array).__name__}: numpy, cupy or torch arrays")
