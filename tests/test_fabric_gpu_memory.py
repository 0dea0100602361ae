"""Registering GPU memory: by dmabuf where the binding and the driver can, else by address,
and which one was used said once; the error text when neither works. Without a GPU, host
memory stands in (shm and tcp turn a dmabuf back into its address, util_mr_map.c), with
the driver's export faked."""
import os

import numpy as np
import pytest

from common.fabric import memory
from common.gpu import cuda_driver
import common.fabric as fi
from common.fabric import ffi, lib
from tests.support import fake_info
from tests.support.gpu import needs_gpu

PAGE = 4096


def pipe_fd():
    """An fd that stands in for a dmabuf; the other end is closed at once."""
    read, write = os.pipe()
    os.close(write)
    return read


def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def write_to_self(info, domain, cq, av, ep, address, mr, offset, data):
    """WRITE `data` to `offset` of the memory at `address`, registered as `mr`, through
    our own endpoint, and wait for its immediate: the bytes have landed then."""
    me = fi.av_insert(av, fi.getname(ep))
    with fi.Closer() as own:
        fi.Inbox(own, domain, ep, 64)  # for providers that consume a receive per immediate
        src = ffi.new("char[]", data)
        src_mr = own(fi.mr_reg(domain, src, len(data), lib.FI_WRITE, key=9))
        ctx, poller = ffi.new("struct fi_context2 *"), fi.Poller(cq)
        base = fi.remote_base(info, address)
        poller.until_posted(lambda: fi.writemsg(ep, src, len(data), fi.mr_desc(src_mr), me,
                                                base + offset, fi.mr_key(mr), ctx, data=7),
                            10, "WRITE")
        poller.wait([ctx], 10, "WRITE completion")
        assert poller.wait_remote_data(10, "the WRITE's immediate") == 7


def test_dmabuf_registration_lands_where_the_offset_says(provider):
    """With FI_MR_DMABUF the buffer's address is the base plus the offset: a WRITE at an
    offset into it lands there. A binding built against libfabric < 1.20 says why not."""
    info, _ = fi.pick(provider, lib.FI_MSG | lib.FI_RMA)
    raw = np.zeros(4 * PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    region = raw[start:start + 3 * PAGE]
    buf = region[100:100 + 2 * PAGE]  # not page-aligned: the offset matters
    fd = pipe_fd()
    with fi.Closer() as own:
        domain, cq, av, ep = fi.open_endpoint(own, info)
        mr, how = memory.register_device(domain, buf.ctypes.data, buf.size,
                                         lib.FI_REMOTE_WRITE, 5, lib.FI_HMEM_SYSTEM, 0,
                                         handle=lambda ptr, size: (fd, ptr - region.ctypes.data))
        own(mr)
        why = memory.dmabuf_missing(fi.mr_mode(domain))
        if why:  # libfabric < 1.20; tcp (offsets)
            assert how == f"GPU memory registered by address (no dmabuf: {why})"
            assert is_open(fd)  # never asked for
            os.close(fd)
        else:
            assert how == "GPU memory registered by dmabuf"
            assert not is_open(fd)  # closed once registered: no provider keeps it
        data = bytes(range(256)) * 4
        write_to_self(info, domain, cq, av, ep, buf.ctypes.data, mr, 300, data)
        assert bytes(buf[300:300 + len(data)]) == data
        assert not buf[:300].any() and not buf[300 + len(data):].any()


def test_dmabuf_needs_the_1_20_api_and_virtual_addresses():
    """1.17's headers have no FI_MR_DMABUF; 2.1.0's util MR map (tcp) takes the base of an
    offset-addressed registration from mr_iov, which for a dmabuf is the dmabuf
    (prov/util/src/util_mr_map.c, ofi_mr_map_insert): WRITEs into it miss."""
    built = f"{lib.FI_MAJOR_VERSION}.{lib.FI_MINOR_VERSION}"
    offsets = fi.MR_MODE & ~lib.FI_MR_VIRT_ADDR
    if not lib.tut_has_dmabuf():
        old = f"built against libfabric {built}; FI_MR_DMABUF came in 1.20"
        assert memory.dmabuf_missing(fi.MR_MODE) == memory.dmabuf_missing(offsets) == old
    else:
        assert memory.dmabuf_missing(fi.MR_MODE) is None
        assert "no FI_MR_VIRT_ADDR" in memory.dmabuf_missing(offsets)


def test_without_the_driver_registration_is_by_address_and_says_why(monkeypatch):
    monkeypatch.setattr(memory, "dmabuf_missing", lambda mode: None)  # as with libfabric >= 1.20
    info, _ = fi.pick("shm", lib.FI_MSG | lib.FI_RMA)
    buf = np.zeros(PAGE, np.uint8)

    def no_driver(ptr, size):
        raise ValueError("cannot load the CUDA driver: libcuda.so.1: cannot open shared "
                         "object file")
    with fi.Closer() as own:
        domain, *_ = fi.open_endpoint(own, info)
        mr, how = memory.register_device(domain, buf.ctypes.data, buf.size, lib.FI_REMOTE_WRITE,
                                         5, lib.FI_HMEM_SYSTEM, 0, handle=no_driver)
        own(mr)
    assert how == ("GPU memory registered by address (no dmabuf: cannot load the CUDA driver: "
                   "libcuda.so.1: cannot open shared object file)")


def test_a_refused_dmabuf_falls_back_to_the_address_and_closes_the_fd(monkeypatch):
    monkeypatch.setattr(memory, "dmabuf_missing", lambda mode: None)
    refusals = []

    def refuse_dmabuf(domain, *args, dmabuf=None, **kw):
        if dmabuf:
            refusals.append(dmabuf)
            raise fi.FabricError("fi_mr_regattr", -lib.FI_EINVAL)
        return real(domain, *args, **kw)
    real = fi.mr_reg
    monkeypatch.setattr(fi, "mr_reg", refuse_dmabuf)
    info, _ = fi.pick("shm", lib.FI_MSG | lib.FI_RMA)
    buf, fd = np.zeros(PAGE, np.uint8), pipe_fd()
    with fi.Closer() as own:
        domain, *_ = fi.open_endpoint(own, info)
        mr, how = memory.register_device(domain, buf.ctypes.data, buf.size, lib.FI_REMOTE_WRITE,
                                         5, lib.FI_HMEM_SYSTEM, 0, handle=lambda p, s: (fd, 0))
        own(mr)
    assert refusals == [(fd, 0)] and not is_open(fd)
    assert how.startswith("GPU memory registered by address (no dmabuf: fi_mr_regattr: ")
    assert how.endswith(" with FI_MR_DMABUF)")


@pytest.mark.parametrize("rc, says", [
    (-lib.FI_ENOSYS, "this libfabric was built without CUDA"),
    (-lib.FI_EINVAL, "cannot register GPU memory by address"),
])
def test_registration_errors_name_the_fix(monkeypatch, rc, says):
    """-FI_ENOSYS is a libfabric without CUDA (efa_mr.c, verbs_mr.c, util_mr_map.c): build
    one. Anything else is the NIC refusing the address: nvidia_peermem, or dmabuf."""
    def fail(*args, **kw):
        raise fi.FabricError("fi_mr_regattr", rc)
    monkeypatch.setattr(fi, "mr_reg", fail)
    monkeypatch.setattr(fi, "mr_mode", lambda domain: fi.MR_MODE)
    with pytest.raises(ValueError) as err:
        memory.register_device(None, 0x1000, PAGE, lib.FI_REMOTE_WRITE, 5, lib.FI_HMEM_CUDA, 0,
                               handle=lambda p, s: (pipe_fd(), 0))
    text = str(err.value)
    assert text.startswith(says) and "\n" not in text
    if rc == -lib.FI_ENOSYS:
        assert "scripts/build_libfabric.sh" in text and "/opt/amazon/efa" in text
    else:
        assert "modprobe nvidia_peermem" in text and "by dmabuf: " in text


def test_dmabuf_asks_the_driver_for_whole_host_pages(monkeypatch):
    """cuMemGetHandleForAddressRange wants a page-aligned range (cuda.h): ask for the pages
    around the buffer, and give its offset in them."""
    asked = []

    class Driver:
        def cuMemGetHandleForAddressRange(self, fd, start, length, kind, flags):
            asked.append((start, length, kind, flags))
            fd[0] = 42
            return 0
    monkeypatch.setattr(cuda_driver, "_loaded", [Driver()])
    assert cuda_driver.dmabuf(3 * PAGE + 100, PAGE) == (42, 100)
    assert asked == [(3 * PAGE, 2 * PAGE, cuda_driver.DMA_BUF_FD, 0)]
    assert cuda_driver.dmabuf(2 * PAGE, PAGE) == (42, 0)
    assert asked[-1][:2] == (2 * PAGE, PAGE)


def test_dmabuf_says_the_drivers_error(monkeypatch):
    class Driver:
        def cuMemGetHandleForAddressRange(self, *args):
            return 801

        def cuGetErrorName(self, rc, name):
            name[0] = keep
            return 0
    keep = cuda_driver.ffi.new("char[]", b"CUDA_ERROR_NOT_SUPPORTED")
    monkeypatch.setattr(cuda_driver, "_loaded", [Driver()])
    with pytest.raises(ValueError, match="^cuMemGetHandleForAddressRange: "
                                         "CUDA_ERROR_NOT_SUPPORTED$"):
        cuda_driver.dmabuf(PAGE, PAGE)


def test_which_way_is_said_once_per_run(monkeypatch, capsys):
    ways = iter(["GPU memory registered by dmabuf"] * 2 + ["GPU memory registered by address "
                                                            "(no dmabuf: x)"])
    monkeypatch.setattr(memory, "register_device", lambda *a: (object(), next(ways)))
    monkeypatch.setattr(memory, "_said", set())
    buf = type("GpuBuffer", (), dict(gpu=0, ptr=0, size=1, iface=lib.FI_HMEM_CUDA, device=0))
    for _ in range(3):
        memory.register(lambda mr: mr, None, buf, lib.FI_REMOTE_WRITE, 1)
    assert capsys.readouterr().out.splitlines() == [
        "GPU memory registered by dmabuf", "GPU memory registered by address (no dmabuf: x)"]


def test_efa_without_gpudirect_stops_at_the_endpoint(monkeypatch):
    """efa's RDM fabric registers GPU memory its device cannot reach with a made-up key
    (rdm/efa_rdm_mr.c efa_rdm_mr_reg_impl) and copies every transfer through host memory:
    the endpoint for GPU memory requires P2P before fi_enable, so the run stops there, in
    one line that names what is missing, before any registration says "by dmabuf"."""
    efa = fake_info.efa_over_shm(monkeypatch, lib.FI_MSG | lib.FI_RMA | lib.FI_HMEM)
    with fi.Closer() as own, pytest.raises(ValueError) as stopped:
        fi.open_endpoint(own, efa)
    line = str(stopped.value)
    assert "\n" not in line and line.startswith("efa: the EFA device cannot reach GPU memory")
    for missing in ("nvidia-peermem", "dmabuf", "FI_HMEM_P2P_DISABLED", "host memory"):
        assert missing in line, line


def test_efa_on_host_memory_requires_no_gpudirect(monkeypatch):
    with fi.Closer() as own:
        fi.open_endpoint(own, fake_info.efa_over_shm(monkeypatch, lib.FI_MSG | lib.FI_RMA))


@needs_gpu
def test_gpu_memory_is_registered_by_dmabuf_where_the_binding_has_it(capsys):
    """On the H200 machine (CUDA says dma-buf supported; environment.md) with a libfabric
    >= 1.20: cupy memory by dmabuf, and a WRITE into it verified."""
    cp = memory.cupy()
    info, _ = fi.pick("shm", lib.FI_MSG | lib.FI_RMA, hmem=True)
    target = memory.Buffer(1 << 20, 0)
    with fi.Closer() as own:
        domain, cq, av, ep = fi.open_endpoint(own, info)
        mr, how = memory.register_device(domain, target.ptr + 100, target.size - 100,
                                         lib.FI_REMOTE_WRITE, 5, target.iface, target.device)
        own(mr)
        why = memory.dmabuf_missing(fi.mr_mode(domain))
        assert how == ("GPU memory registered by dmabuf" if not why else
                       f"GPU memory registered by address (no dmabuf: {why})")
        data = bytes(range(256)) * 16
        write_to_self(info, domain, cq, av, ep, target.ptr + 100, mr, 1000, data)
        memory.synchronize(0)
        assert target.read(1100, len(data)).tobytes() == data
        assert not cp.asnumpy(target.array[:1100]).any()
