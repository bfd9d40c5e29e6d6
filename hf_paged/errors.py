"""Exceptions raised by hf_paged."""


class PoolExhaustedError(RuntimeError):
    """The block pool has fewer free blocks than a request needs.

    The call that raised it changed nothing: the allocator is exactly as it was before.

    Attributes:
        num_needed (`int`): blocks the request needed.
        num_free (`int`): blocks that were free.
        num_blocks (`int | None`): blocks in the whole pool, when known.
        sized_by (`str | None`): what set the pool's size (`"Engine(num_blocks=8)"`, `"the default sizing (...)"`),
            when known.
    """

    def __init__(
        self,
        num_needed: int,
        num_free: int,
        what: str = "the request",
        num_blocks: int | None = None,
        sized_by: str | None = None,
    ):
        self.num_needed = num_needed
        self.num_free = num_free
        self.num_blocks = num_blocks
        self.sized_by = sized_by
        more_memory = "cache_config={'num_blocks': ...} or {'max_memory': ...}"
        if num_blocks is not None and num_needed > num_blocks:
            advice = f"The whole pool has only {num_blocks} blocks: give it more memory ({more_memory}) or shorten "
            advice += "the request."
        else:
            advice = f"Give the pool more memory ({more_memory}), shorten the request, or release caches you no "
            advice += "longer need."
        if sized_by is not None:
            advice += f" The pool's size was set by {sized_by}."
        free = f"only {num_free} is free" if num_free == 1 else f"only {num_free} are free"
        super().__init__(f"KV block pool exhausted: {what} needs {num_needed} more block(s) but {free}. {advice}")


class RequestTooLargeError(PoolExhaustedError):
    """A request needs more blocks at once, in the worst case, than the whole pool has: it is refused before any
    forward runs, whatever the other caches hold. A `PoolExhaustedError`; the message names the blocks needed,
    the pool's size, what set that size and how to change it.

    Attributes:
        num_needed (`int`): the most blocks the request may hold at once.
        num_blocks (`int`): blocks in the whole pool.
        sized_by (`str | None`): what set the pool's size.
    """

    def __init__(self, message: str, num_needed: int, num_free: int, num_blocks: int, sized_by: str | None = None):
        self.num_needed = num_needed
        self.num_free = num_free
        self.num_blocks = num_blocks
        self.sized_by = sized_by
        RuntimeError.__init__(self, message)


class InvariantError(AssertionError):
    """An allocator invariant does not hold; the message names the invariant and the offending block."""


class UnknownAdapterError(ValueError):
    """A request names a LoRA adapter the engine does not serve (never loaded, or unloaded).

    Attributes:
        name (`str`): the name asked for.
        loaded (`list[str]`): the names served.
    """

    def __init__(self, name: str, loaded: list[str]):
        self.name = name
        self.loaded = loaded
        super().__init__(f"unknown adapter {name!r}; loaded adapters: {sorted(loaded) or 'none'}")
