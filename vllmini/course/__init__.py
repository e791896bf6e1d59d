"""Pictures: the page table (static and interactive), and the figures of the notebooks.

One module per kind of picture; every public name is importable from `vllmini.viz`:

- `page_table_layout`, `page_table`: the page-table picture, as plain data (`page_table_layout`) and
  painted (`draw_page_table`), with sharing: several arrows into one page, reference counts,
  copy-on-write pairs, cached-but-free pages; `snapshot`: what it reads from a `BlockManager`.
- `explorer` (+ `explorer_widgets`, `playground`): `PageTableExplorer`, the picture with buttons.
- `blocks`: notebooks 02 and 04 (the pool over time, the slots a query reads); `course`: notebooks 01,
  04 and 09; `serving`: notebook 06; `cuda`: notebooks 05a and 05b;
  `kernel_perf`: notebook 07; `style`: the shared colours.

Viz only reads the state it draws (the explorer changes only the pool it owns). matplotlib and
ipywidgets are imported inside the functions that need them, so `import vllmini` stays light.
"""

from vllmini.viz.blocks import draw_pool_history, draw_slots_read
from vllmini.viz.course import (
    PIPELINE,
    draw_causal_mask,
    draw_flat_batch,
    draw_pipeline,
    draw_prefill_and_decode,
    draw_reservations,
    plot_length_sweeps,
    plot_requests_that_fit,
    plot_token_shares,
)
from vllmini.viz.cuda import (
    WARP_SIZE,
    butterfly_steps,
    draw_butterfly,
    draw_cuda_hierarchy,
    draw_online_softmax,
    draw_page_reads,
    draw_token_mapping,
    online_softmax_trace,
    page_read_owner,
)
from vllmini.viz.explorer import PageTableExplorer
from vllmini.viz.kernel_perf import plot_decode_roofline, plot_kernel_work_split, plot_recorded_bandwidth
from vllmini.viz.page_table import draw_page_table
from vllmini.viz.page_table_layout import PageTableLayout, page_table_layout
from vllmini.viz.serving import (
    TIMELINE_STATES,
    plot_engine_experiment,
    plot_latency_vs_rate,
    plot_pool_and_batch,
    plot_request_timeline,
)
from vllmini.viz.style import (
    CACHED_EDGE,
    CACHED_FACE,
    EMPTY_EDGE,
    EMPTY_FACE,
    FREE_EDGE,
    FREE_FACE,
    HIGHLIGHT,
    OUTPUT_FACE,
    PALETTE,
    POLICY_COLORS,
    PROMPT_FACE,
    ROW_HEIGHT,
    SCHEME_COLORS,
    seq_color,
)

__all__ = [
    "CACHED_EDGE", "CACHED_FACE", "EMPTY_EDGE", "EMPTY_FACE", "FREE_EDGE", "FREE_FACE", "HIGHLIGHT",
    "OUTPUT_FACE", "PALETTE", "PIPELINE", "POLICY_COLORS", "PROMPT_FACE", "ROW_HEIGHT", "SCHEME_COLORS",
    "TIMELINE_STATES", "WARP_SIZE", "PageTableExplorer", "PageTableLayout", "butterfly_steps",
    "draw_butterfly", "draw_causal_mask", "draw_cuda_hierarchy", "draw_flat_batch", "draw_online_softmax",
    "draw_page_reads", "draw_page_table", "draw_pool_history", "draw_slots_read", "draw_pipeline",
    "draw_prefill_and_decode", "draw_reservations",
    "draw_token_mapping", "online_softmax_trace", "page_read_owner", "page_table_layout",
    "plot_decode_roofline", "plot_engine_experiment", "plot_kernel_work_split", "plot_latency_vs_rate",
    "plot_length_sweeps", "plot_pool_and_batch", "plot_recorded_bandwidth", "plot_request_timeline",
    "plot_requests_that_fit", "plot_token_shares", "seq_color",
]  # fmt: skip
