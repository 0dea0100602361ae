"""The transfer engine's byte formats: an engine's address and a region's descriptor, and
what the CUDA IPC route (ipc.py) puts in each.

Both are bytes a program hands to its peer however it likes (printed and pasted, a control
message, an allgather), so each starts with a magic and is parsed with one-line errors.
"""
import struct

MAGIC_ADDRESS, MAGIC_REGION = b"TXA3", b"TXR1"
# magic, engine id, NIC count, control address length, inbox length (0 or HOST.size),
# provider name length (fabric.name_of: shm, tcp, efa, efa-direct, verbs)
ADDRESS = struct.Struct("<4sIHHHB")
BYTES = (bytes, bytearray, memoryview)
NAME = struct.Struct("<H")          # a data NIC's address length (+ the address)
REGION = struct.Struct("<4sQQH")    # magic, address, size, NIC count
NIC_KEY = struct.Struct("<QQ")      # per NIC: remote base, key
# In an engine's address: this host (boot id, pid namespace), the inbox (pid, fd) and the
# GPU (its PCI bus id, which names it whatever CUDA_VISIBLE_DEVICES says)
HOST = struct.Struct("<16sQII16s")
# In a region's descriptor: the allocation's IPC handle, the region's offset in it, its pid
HANDLE = struct.Struct("<4s64sQI")
MAGIC_HANDLE = b"IPC1"


def pack_address(ident, provider, control, inbox, names, signal):
    """An engine's address: its id, provider, control address, CUDA IPC inbox (HOST, or
    b""), each data NIC's address and its signal region's descriptor."""
    provider = provider.encode()
    return (ADDRESS.pack(MAGIC_ADDRESS, ident, len(names), len(control), len(inbox),
                         len(provider))
            + provider + control + inbox + b"".join(NAME.pack(len(n)) + n for n in names)
            + signal)


def parse_address(address):
    """(id, provider, control address, inbox, data NICs' addresses, signal descriptor) of
    an engine's address (pack_address); ValueError in one line if it is not one."""
    if not isinstance(address, BYTES):
        raise ValueError(f"an engine's address is bytes (Engine.address()), not a "
                         f"{type(address).__name__}")
    address = bytes(address)
    try:
        magic, ident, count, length, inbox_size, named = ADDRESS.unpack_from(address)
        if magic != MAGIC_ADDRESS or inbox_size not in (0, HOST.size):
            raise ValueError
        at = ADDRESS.size
        provider, at = address[at:at + named].decode(), at + named
        control, at = address[at:at + length], at + length
        inbox, at = address[at:at + inbox_size], at + inbox_size
        names = []
        for _ in range(count):
            (size,), at = NAME.unpack_from(address, at), at + NAME.size
            names.append(address[at:at + size])
            at += size
        signal = address[at:]
        if (len(control) != length or len(inbox) != inbox_size or any(not n for n in names)
                or not count):
            raise ValueError
    except (struct.error, ValueError):  # UnicodeDecodeError too
        raise ValueError(f"not an engine's address ({len(address)} bytes): pass the bytes of "
                         "another engine's Engine.address(), whole and unchanged (bytes.fromhex "
                         "them first where they travelled as hex)") from None
    return ident, provider, control, inbox, names, signal


def pack_region(ptr, size, bases, keys, ipc_handle):
    """A region's descriptor: address, size, per NIC (remote base, key), and the CUDA IPC
    handle (HANDLE) of GPU memory that can be shared, else b""."""
    return (REGION.pack(MAGIC_REGION, ptr, size, len(keys))
            + b"".join(NIC_KEY.pack(b, k) for b, k in zip(bases, keys))
            + ipc_handle)


def parse_region(descriptor):
    """(address, size, remote bases, keys, (handle, offset, pid) or None) of a region's
    descriptor (pack_region); ValueError in one line if it is not one."""
    if not isinstance(descriptor, BYTES):
        raise ValueError(f"a region descriptor is bytes (Region.descriptor()), not a "
                         f"{type(descriptor).__name__}")
    descriptor = bytes(descriptor)
    try:
        magic, ptr, size, count = REGION.unpack_from(descriptor)
        keys = REGION.size + count * NIC_KEY.size
        if magic != MAGIC_REGION or len(descriptor) not in (keys, keys + HANDLE.size):
            raise ValueError
        handle = parse_handle(descriptor[keys:]) if len(descriptor) > keys else None
    except (struct.error, ValueError):
        raise ValueError(f"not a region descriptor ({len(descriptor)} bytes): pass the bytes "
                         "of a Region.descriptor(), whole and unchanged") from None
    pairs = [NIC_KEY.unpack_from(descriptor, REGION.size + i * NIC_KEY.size)
             for i in range(count)]
    return ptr, size, [b for b, _ in pairs], [k for _, k in pairs], handle


def pack_host(boot, namespace, pid, fd, bus):
    """An engine's CUDA IPC inbox, in its address (HOST): this host, the inbox's memfd, the
    GPU's PCI bus id (a str)."""
    return HOST.pack(boot, namespace, pid, fd, bus.encode())


def parse_host(data):
    """(boot id, pid namespace, pid, fd, bus id) of pack_host's bytes."""
    boot, namespace, pid, fd, bus = HOST.unpack(data)
    return boot, namespace, pid, fd, bus.rstrip(b"\0").decode()


def pack_handle(handle, offset, pid):
    """A region descriptor's trailer for GPU memory (HANDLE): its allocation's CUDA IPC
    handle (64 bytes), the region's offset in that allocation, the exporting pid."""
    return HANDLE.pack(MAGIC_HANDLE, handle, offset, pid)


def parse_handle(trailer):
    """(handle, offset, pid) of a descriptor's trailer, or ValueError."""
    magic, handle, offset, pid = HANDLE.unpack(trailer)
    if magic != MAGIC_HANDLE:
        raise ValueError("not a CUDA IPC handle")
    return handle, offset, pid
