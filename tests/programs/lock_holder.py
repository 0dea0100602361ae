"""A client killed while it holds the server's shm region lock, for tests/test_fabric_own_lock.py.

What a client SIGKILLed in the middle of a post to the server leaves (libfabric < 1.18:
smr_generic_rma, prov/shm/src/smr_rma.c, and smr_generic_sendmsg, smr_msg.c, take the
server's region lock to put their command there): the lock held, its holder gone. Found
by chance about once in 120 such kills; here at once, by taking the lock ourselves.

    lock_holder.py ADDRESS [stop]   take the lock of the server at ADDRESS (hex), say
                                    "holding", then die by SIGKILL (or, with `stop`,
                                    stop ourselves by SIGSTOP: a client stopped mid-post)
"""
import ctypes
import mmap
import os
import signal
import sys

LOCK_AT = 24  # offsetof(struct smr_region, lock) in 1.17 (include/ofi_shm.h)
LIBC = ctypes.CDLL(None, use_errno=True)


def main():
    name = bytes.fromhex(sys.argv[1]).rstrip(b"\0").decode().split("://", 1)[-1]
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    region = mmap.mmap(fd, mmap.PAGESIZE)
    lock = ctypes.addressof(ctypes.c_char.from_buffer(region, LOCK_AT))
    LIBC.pthread_spin_lock(ctypes.c_void_p(lock))
    print("holding", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP if sys.argv[2:] == ["stop"] else signal.SIGKILL)


if __name__ == "__main__":
    main()
