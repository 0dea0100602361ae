"""The transfer engine's byte formats: an engine's address and a region's descriptor.

Both are bytes a program hands to its peer however it likes (printed and pasted, a control
message, an allgather), so each starts with a magic and is parsed with one-line errors.
"""
import struct

from common.transfer import ipc

MAGIC_ADDRESS, MAGIC_REGION = b"TXA2", b"TXR1"
# magic, engine id, NIC count, control address length, inbox length (0 or ipc.HOST.size)
ADDRESS = struct.Struct("<4sIHHH")
NAME = struct.Struct("<H")          # a data NIC's address length (+ the address)
REGION = struct.Struct("<4sQQH")    # magic, address, size, NIC count
NIC_KEY = struct.Struct("<QQ")      # per NIC: remote base, key


def pack_address(ident, control, inbox, names, signal):
    """An engine's address: its id, control address, CUDA IPC inbox (ipc.HOST, or b""),
    each data NIC's address and its signal region's descriptor."""
    return (ADDRESS.pack(MAGIC_ADDRESS, ident, len(names), len(control), len(inbox))
            + control + inbox + b"".join(NAME.pack(len(n)) + n for n in names) + signal)


def parse_address(address):
    """(id, control address, inbox, data NICs' addresses, signal descriptor) of an
    engine's address (pack_address); ValueError in one line if it is not one."""
    try:
        magic, ident, count, length, inbox_size = ADDRESS.unpack_from(address)
        if magic != MAGIC_ADDRESS or inbox_size not in (0, ipc.HOST.size):
            raise ValueError
        at = ADDRESS.size
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
    except (struct.error, ValueError, TypeError):
        raise ValueError(f"not an engine's address ({len(address)} bytes): copy the "
                         "whole address that the server printed") from None
    return ident, control, inbox, names, signal


def pack_region(ptr, size, bases, keys, ipc_handle):
    """A region's descriptor: address, size, per NIC (remote base, key), and the CUDA IPC
    handle (ipc.HANDLE) of GPU memory that can be shared, else b""."""
    return (REGION.pack(MAGIC_REGION, ptr, size, len(keys))
            + b"".join(NIC_KEY.pack(b, k) for b, k in zip(bases, keys))
            + ipc_handle)


def parse_region(descriptor):
    """(address, size, remote bases, keys, (handle, offset, pid) or None) of a region's
    descriptor (pack_region); ValueError in one line if it is not one."""
    try:
        magic, ptr, size, count = REGION.unpack_from(descriptor)
        keys = REGION.size + count * NIC_KEY.size
        if magic != MAGIC_REGION or len(descriptor) not in (keys, keys + ipc.HANDLE.size):
            raise ValueError
        handle = ipc.parse_handle(descriptor[keys:]) if len(descriptor) > keys else None
    except (struct.error, ValueError, TypeError):
        raise ValueError(f"not a region descriptor ({len(descriptor)} bytes): use "
                         "Region.descriptor()") from None
    pairs = [NIC_KEY.unpack_from(descriptor, REGION.size + i * NIC_KEY.size)
             for i in range(count)]
    return ptr, size, [b for b, _ in pairs], [k for _, k in pairs], handle
