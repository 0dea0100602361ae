"""What a serving engine asks of a GPU all-to-all (chapter 17's) at its door: its arrays
taken as they come, cupy arrays or torch tensors (through DLPack: no copy), and given back
of the same kind; each half run after the work the caller queued on its current stream,
and before what it queues next, while the kernels run on the all-to-all's own stream."""


class Caller:
    """The caller's arrays and stream, for the halves of an all-to-all whose kernels run on
    `stream` (cupy's `xp`). `with caller:` around a half's launches: our stream waits for
    the caller's current one, cupy's own work in the half goes on ours, and the caller's
    waits for ours once the half is queued."""

    def __init__(self, xp, stream):
        self.xp, self.stream = xp, stream
        self.forked, self.joined = (xp.cuda.Event(disable_timing=True) for _ in range(2))
        self.torch, self.theirs = False, None

    def take(self, *arrays):
        """The caller's arrays as cupy arrays; remembers which kind to give back."""
        self.torch = False
        if all(type(a) is self.xp.ndarray for a in arrays):  # the common case, at no cost
            return arrays
        self.torch = any(type(a).__module__.startswith("torch") for a in arrays)
        return [self.xp.from_dlpack(a) if type(a).__module__.startswith("torch") else a
                for a in arrays]

    def give(self, array):
        """`array` as the kind the caller gave: torch's stream then waits for ours."""
        if array is None or not self.torch:
            return array
        import torch  # the caller has it: it gave us torch tensors
        return torch.from_dlpack(array)

    def __enter__(self):
        current = self.xp.cuda.get_current_stream()
        self.theirs = None if current.ptr == self.stream.ptr else current
        if self.theirs is not None:
            self.forked.record(self.theirs)
            self.stream.wait_event(self.forked)
            self.stream.use()
        return self

    def __exit__(self, *failed):
        if self.theirs is not None:
            self.joined.record(self.stream)
            self.theirs.wait_event(self.joined)
            self.theirs.use()
