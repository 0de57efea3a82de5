"""The kernel toolkit: what every backend needs, public and stable.

Built-in backends import only ``moe_dispatch`` and this module, exactly as a vendor's
backend does:

- routing steps: :func:`sort_by_expert` (prepare), :func:`grouped_by_expert` (a per-expert
  loop), :func:`scale_rows` (router weight on the input), :func:`combine` (finalize: the
  router weight applied exactly once, scatter-add in float32);
- :func:`gated_activation` by each activation's exact math, and :func:`expert_loop`, the
  portable kernel on the canonical weights;
- id checks that stay cheap at decode: :func:`id_range`, :func:`ids_in_range`,
  :func:`check_id_range` (raises), :func:`has_duplicate_in_row`;
- :func:`op_problem` / :func:`schema_problem`: an op's presence and schema checked by
  argument names and types;
- weight ownership: :func:`owned_copy`, :func:`version_stamp`, :func:`stamp_matches`;
  :func:`large_zeros` / :func:`large_copy` for prepacked weights in transparent huge pages
  where the OS offers them (:func:`thp_mode`);
- :class:`NativeExtension` and :func:`cache_dir`: C++ built on first use into the user cache;
- :func:`dtype_name`.
"""

from .._config import dtype_name
from ._activations import gated_activation
from ._grouping import ExpertFn, ExpertOrder, combine, grouped_by_expert, scale_rows, sort_by_expert
from ._ids import SMALL_IDS, check_id_range, has_duplicate_in_row, id_range, ids_in_range
from ._loop import expert_loop, quantized_expert_loop
from ._native import NativeExtension, cache_dir
from ._pages import huge_pages_used, large_copy, large_zeros, thp_mode
from ._schema import Argument, op_problem, schema_arguments, schema_problem
from ._weights import owned_copy, stamp_matches, version_of, version_stamp

__all__ = [
    "Argument", "ExpertFn", "ExpertOrder", "NativeExtension", "SMALL_IDS", "cache_dir", "check_id_range", "combine",
    "dtype_name", "expert_loop", "gated_activation", "grouped_by_expert", "has_duplicate_in_row", "huge_pages_used",
    "large_copy", "large_zeros", "quantized_expert_loop",
    "id_range", "ids_in_range", "op_problem", "owned_copy", "scale_rows", "schema_arguments", "schema_problem",
    "sort_by_expert", "stamp_matches", "thp_mode", "version_of", "version_stamp",
]
