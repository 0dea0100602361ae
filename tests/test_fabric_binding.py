"""The cffi binding: versions, fi_getinfo, errors, closing order."""
import os
import shutil
import signal
import subprocess
import sys
import time

import argparse

import pytest

from common import cli
import common.fabric as fi
from common.fabric import ffi, lib
from tests.support import fake_info
from tests.support.shm_regions import files as shm_files


def test_version_is_at_least_what_we_support():
    assert fi.version() >= (1, 17)
    assert (lib.FI_MAJOR_VERSION, lib.FI_MINOR_VERSION) >= (1, 17)  # the headers we built with


@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_getinfo_finds_an_rdm_endpoint(name):
    info = fi.getinfo(fi.hints(name, caps=lib.FI_MSG | lib.FI_RMA))
    entries = list(fi.each(info))
    assert entries
    for e in entries:
        assert fi.provider_of(e).split(";")[0] == name
        assert e.ep_attr.type == lib.FI_EP_RDM
        assert e.caps & lib.FI_RMA and e.caps & lib.FI_MSG


def test_dupinfo_outlives_its_list():
    head = fi.getinfo(fi.hints("shm"))
    copy = fi.dupinfo(head)
    del head
    assert fi.provider_of(copy) == "shm" and copy.next == ffi.NULL


def test_failing_call_raises_with_name_code_and_text():
    with pytest.raises(fi.FabricError) as err:
        fi.getinfo(fi.hints("shm", ep_type=lib.FI_EP_DGRAM))  # shm has only RDM endpoints
    assert err.value.call == "fi_getinfo"
    assert err.value.rc == -lib.FI_ENODATA
    assert err.value.text == ffi.string(lib.fi_strerror(lib.FI_ENODATA)).decode()
    assert "fi_getinfo" in str(err.value) and err.value.text in str(err.value)


def test_check_passes_through_success_and_translates_failure():
    assert fi.check("fi_x", 3) == 3
    with pytest.raises(fi.FabricError, match=r"^fi_x: .* \(ret -\d+\)$"):
        fi.check("fi_x", -lib.FI_EINVAL)


def test_pick_tells_unknown_from_absent(monkeypatch):
    with pytest.raises(ValueError, match="unknown provider 'nosuch'"):
        fi.pick("nosuch")
    fake_info.pretend(monkeypatch, absent=("efa",))
    with pytest.raises(ValueError, match="'efa' has no usable device here"):
        fi.pick("efa")
    info, why = fi.pick(None)
    assert fi.provider_of(info).split(";")[0] in fi.DEFAULT_PROVIDERS and "default" in why


@pytest.mark.parametrize("present,chosen,why", [
    ((), "shm", "default: no efa/verbs device here"),
    (("verbs",), "verbs;ofi_rxm", "default: no efa device here"),
    (("efa", "verbs"), "efa", "default"),
])
def test_the_default_is_the_first_real_nic(monkeypatch, capsys, present, chosen, why):
    """What the chapters, cli.pick_provider and the tour (fi.pick of its -p) choose when
    no provider is named, with NICs faked present or absent (shm is real)."""
    fake_info.pretend(monkeypatch, present, absent={"efa", "verbs"} - set(present))
    info, said = fi.pick(None)
    assert (fi.provider_of(info), said) == (chosen, why)
    cli.pick_provider(argparse.Namespace(provider=None))
    assert capsys.readouterr().out.startswith(f"provider: {chosen} ({why}), fabric ")


def test_endpoint_round_trip_and_address_shape(provider):
    info, _ = fi.pick(provider)
    with fi.Closer() as own:
        domain, cq, av, ep = fi.open_endpoint(own, info)
        name = fi.getname(ep)
        fi.check_address(info, name)  # our own address has the right shape
        assert fi.av_insert(av, name) != lib.FI_ADDR_UNSPEC
        with pytest.raises(ValueError):
            fi.check_address(info, name[:-2] + b"xx" if provider == "shm" else name[:4])
        buf = ffi.new("char[]", 64)
        mr = own(fi.mr_reg(domain, buf, 64, lib.FI_SEND | lib.FI_RECV, key=7))
        assert fi.mr_key(mr) is not None
        assert fi.cq_read(cq, fi.cq_entries(4)) == 0  # nothing posted, nothing completes


def test_send_to_self_completes_on_both_sides(provider):
    """SEND/RECV through one endpoint to itself: the binding's data path end to end."""
    info, _ = fi.pick(provider)
    with fi.Closer() as own:
        domain, cq, av, ep = fi.open_endpoint(own, info)
        me = fi.av_insert(av, fi.getname(ep))
        src, dst = ffi.new("char[]", b"binding works"), ffi.new("char[]", 64)
        mr_src = own(fi.mr_reg(domain, src, len(src), lib.FI_SEND, key=1))
        mr_dst = own(fi.mr_reg(domain, dst, len(dst), lib.FI_RECV, key=2))
        rctx, sctx = ffi.new("struct fi_context2 *"), ffi.new("struct fi_context2 *")
        assert fi.recvmsg(ep, dst, 64, fi.mr_desc(mr_dst), lib.FI_ADDR_UNSPEC, rctx)
        poller = fi.Poller(cq)
        while not fi.sendmsg(ep, src, len(src), fi.mr_desc(mr_src), me, sctx):
            poller.poll()
        poller.wait([sctx], 10, "send completion")
        _, length = poller.wait([rctx], 10, "receive completion")
        assert length == len(src) and ffi.string(dst) == b"binding works"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU is present")
def test_cuda_registration_fails_cleanly_without_a_gpu():
    info, _ = fi.pick("shm")
    with fi.Closer() as own:
        domain, *_ = fi.open_endpoint(own, info)
        with pytest.raises(fi.FabricError) as err:
            fi.mr_reg(domain, 0x1000, 4096, lib.FI_WRITE, key=1, iface=lib.FI_HMEM_CUDA)
        assert err.value.call == "fi_mr_regattr"


def test_closer_closes_in_reverse_order_also_on_error():
    info, _ = fi.pick("shm")
    before = shm_files(os.getpid())  # others' regions may come and go meanwhile
    closed = []
    with pytest.raises(RuntimeError, match="boom"):
        with fi.Closer() as own:
            own.callback(closed.append, "last")
            fi.open_endpoint(own, info)
            own.callback(closed.append, "first")
            assert shm_files(os.getpid()) - before  # the endpoint's shm region exists now
            raise RuntimeError("boom")
    assert closed == ["first", "last"]
    assert not shm_files(os.getpid()) - before  # fi_close of the endpoint removed it


def test_tostr_uses_libfabric_names():
    assert "FI_RMA" in fi.tostr(lib.FI_RMA | lib.FI_MSG, lib.FI_TYPE_CAPS)
    assert fi.tostr(lib.FI_EP_RDM, lib.FI_TYPE_EP_TYPE) == "FI_EP_RDM"


def test_ctrl_c_stays_ours_from_import_on():
    """Loading libfabric lets PSM install handlers that exit(1) on Ctrl-C; importing the
    binding takes SIGINT back at once (not only at the first fi_getinfo)."""
    child = subprocess.Popen([sys.executable, "-c", "import common.fabric, time; "
                              "print('up', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        time.sleep(0.2)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=10)
    finally:
        child.kill()
    assert "KeyboardInterrupt" in err and child.returncode != 1


def test_loading_libfabric_installs_no_handler_of_its_providers():
    """Debian's PSM (libinfinipath) installs backtrace handlers for SIGTERM, SIGINT and the
    crash signals as libfabric loads it: a thread numpy had started took a SIGTERM there
    and the process ran on. The binding asks it not to (IPATH_NO_BACKTRACE)."""
    show = ("import ctypes, signal, common.fabric\n"
            "act = (ctypes.c_void_p * 32)()\n"  # struct sigaction: the handler comes first
            "ctypes.CDLL(None).sigaction(signal.SIGSEGV, None, act)\n"
            "print(act[0] or 0)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("IPATH_NO_BACKTRACE", "PYTHONFAULTHANDLER")}  # faulthandler: its own
    done = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.stdout.strip() == "0", f"SIGSEGV's handler: {done.stdout}{done.stderr}"


def test_a_region_left_under_this_pid_does_not_stop_its_endpoints():
    """A SIGKILLed process leaves its shm region, named after its pid. When the pids came
    round, the process given that pid had fi_enable refused (EBUSY: prov/shm/src/smr_util.c,
    smr_retry_map), four processes of one CI run. The binding removes such a leftover."""
    run = ("import os\n"
           "name = f'/dev/shm/{os.getpid()}:{os.getuid()}:0'\n"
           "with open(name, 'wb') as f:\n"
           "    f.write(bytes(1 << 16))\n"  # what a process killed inside smr_create leaves
           "import common.fabric as fi\n"
           "info, _ = fi.pick('shm')\n"
           "with fi.Closer() as own:\n"
           "    fi.open_endpoint(own, info)\n"
           "    print('enabled')\n")
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout == "enabled\n", done.stdout + done.stderr
