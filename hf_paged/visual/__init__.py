"""Pictures of the block pool: which sequence owns which physical block, and naive reservation next to paging.

`pool_snapshot` reads an allocator and the block tables to show; `render_pool_text` prints it with one character per
block; `plot_pool` and `plot_fragmentation` draw matplotlib figures. Only the two `plot_*` functions need matplotlib
(`pip install "hf_paged[viz]"`), and they import it when called, so `import hf_paged` never does.
"""

from .figures import plot_fragmentation, plot_pool
from .snapshot import BlockView, PoolSnapshot, pool_snapshot
from .text import render_pool_text

__all__ = ["BlockView", "PoolSnapshot", "plot_fragmentation", "plot_pool", "pool_snapshot", "render_pool_text"]
