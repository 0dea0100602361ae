"""Where GPU tests can run: a GPU, cupy, and a libfabric that registers CUDA memory."""
import functools
import importlib.util
import shutil

import pytest


@functools.cache
def why_not():
    """None when GPU tests can run here, else the reason they are skipped."""
    if importlib.util.find_spec("cupy") is None or shutil.which("nvidia-smi") is None:
        return "needs a GPU and cupy"
    import cupy
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "needs a GPU"
    except cupy.cuda.runtime.CUDARuntimeError:
        return "needs a GPU (CUDA runtime found none)"
    import common.fabric as fi
    from common.fabric import memory
    try:  # the real question: can this libfabric register CUDA memory?
        info, _ = fi.pick("shm", fi.lib.FI_MSG | fi.lib.FI_RMA, hmem=True)
        with fi.Closer() as own:
            fabric = own(fi.fabric_open(info))
            domain = own(fi.domain_open(fabric, info))
            memory.register(own, domain, memory.Buffer(1 << 20, 0), fi.lib.FI_REMOTE_WRITE, 1)
    except (ValueError, fi.FabricError) as e:
        return f"needs a CUDA-enabled libfabric ({e})"
    return None


def has_gpu():
    return why_not() is None


def needs_gpu(test):
    """Skip `test`, saying why, unless GPU memory can be used with libfabric here."""
    reason = why_not()
    return pytest.mark.skipif(reason is not None, reason=reason or "")(test)


def needs_gpus(count):
    """Skip unless GPU tests can run here on `count` GPUs."""
    reason = why_not()
    if reason is None:
        import cupy
        have = cupy.cuda.runtime.getDeviceCount()
        reason = f"needs {count} GPUs, has {have}" if have < count else None
    return pytest.mark.skipif(reason is not None, reason=reason or "")
