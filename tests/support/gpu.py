"""The GPU tests' skips: where GPU memory cannot be used with libfabric (common/gpu_ready.py
says why), a test is skipped, saying why."""
import pytest

from common.gpu_ready import why_not


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
