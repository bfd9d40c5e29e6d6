"""Exceptions raised by hf_paged."""


class PoolExhaustedError(RuntimeError):
    """The block pool has fewer free blocks than a request needs.

    The call that raised it changed nothing: the allocator is exactly as it was before.

    Attributes:
        num_needed (`int`): blocks the request needed.
        num_free (`int`): blocks that were free.
    """

    def __init__(self, num_needed: int, num_free: int, what: str = "the request"):
        self.num_needed = num_needed
        self.num_free = num_free
        super().__init__(
            f"KV block pool exhausted: {what} needs {num_needed} more block(s) but only {num_free} are free. "
            "Give the pool more memory (cache_config={'num_blocks': ...} or {'max_memory': ...}), "
            "shorten the request, or release caches you no longer need."
        )


class InvariantError(AssertionError):
    """An allocator invariant does not hold; the message names the invariant and the offending block."""
