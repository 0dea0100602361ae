"""libfabric's negative return codes as exceptions."""
from common.fabric import rules  # FABRIC_RULES=efa|efa-direct|verbs: checked as those NICs
from common.fabric.binding import ffi, lib


class FabricError(RuntimeError):
    """A libfabric call failed. Carries the call's name, its return code and libfabric's text."""

    def __init__(self, call, rc, text=None):
        self.call, self.rc = call, rc
        self.text = text if text is not None else strerror(rc)
        super().__init__(f"{call}: {self.text} (ret {rc})")


class CompletionError(FabricError):
    """An operation completed with an error; the text is the provider's own (fi_cq_strerror)."""

    def __init__(self, rc, text, context):
        self.context = context
        super().__init__("fi_cq_read", rc, text)


def strerror(rc):
    return rules.text(rc) or ffi.string(lib.fi_strerror(abs(rc))).decode()


def check(call, rc):
    if rc < 0:
        raise FabricError(call, rc)
    return rc
