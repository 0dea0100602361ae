"""Whether GPU memory can be used with libfabric here: a GPU, cupy, and a libfabric that
registers CUDA memory. The tests skip their GPU cases on it, the tour its GPU chapter."""
import functools
import importlib.util
import shutil


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
