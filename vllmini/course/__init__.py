"""The course's own tools: pictures, the page-table explorer, exercise checks, workloads and the serving
sweep. They sit on top of the engine (`vllmini/`), read its state and change nothing in it (the explorer
changes only the pool it owns); nothing in the engine imports them. Import each name from its module.

Which notebook uses which module:

- `memory`: 01 (KV bytes per token, static reservation against paging); its `sample_requests` feeds the
  workloads of 06 and 08. `chapter_plots`: the pictures of 01, 04 (the prefill batch and its mask) and 09
  (the whole pipeline).
- `block_plots`: 02 (the pool over time) and 04 (the slots a query reads).
- `page_table`: the page-table picture of 03, 06 and 08, drawn from `page_table_layout` (plain data, placed
  by `page_table_places`) of a `snapshot` of a `BlockManager`.
- `explorer`: `PageTableExplorer`, the picture with buttons (03, 08); its widgets in `explorer_widgets`,
  its state and messages in `playground`.
- `cuda_plots`: 05a and 05b (threads, warps, shuffles, the kernel's reads). `kernel_plots`: 07 (the
  roofline and the recorded bandwidth).
- `arrivals` (requests over time), `serving` (the engine under load, on a wall or simulated clock),
  `latency` (metrics and latency against request rate), `serving_plots`: 06.
- `exercises`: the checks of every notebook's exercises. `style`: the colours the pictures share.

matplotlib and ipywidgets are imported inside the functions that need them.
"""
