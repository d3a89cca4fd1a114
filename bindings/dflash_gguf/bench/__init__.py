"""The benchmarks: `dflash bench` (plain decoding vs ours vs upstream llama-server, interleaved) and
`dflash bench --scale` (the same on inflated pairs of realistic sizes), with what they need.

- :mod:`.three_way`: the interleaved run; :mod:`.options`, :mod:`.upstream`, :mod:`.progress`,
  :mod:`.summary`: its options, the llama-server system, progress output, tables and JSON;
- :mod:`.scale`: `--scale`; :mod:`.inflate`: the inflated pairs it generates;
- :mod:`.verify_timing`: the target's verify cost per batch size; :mod:`.plot`: `--plot`;
- :mod:`.synthetic`: GGUF metadata for generated models.
"""

from .options import SYSTEMS, BenchError, BenchOptions, load_prompts, parse_n_max, parse_systems
from .summary import format_table, spread, summarize_config, write_json
from .three_way import run_bench
from .upstream import UpstreamServer, find_server_binary, parse_prometheus

__all__ = [
    "BenchError",
    "BenchOptions",
    "SYSTEMS",
    "UpstreamServer",
    "find_server_binary",
    "format_table",
    "load_prompts",
    "parse_n_max",
    "parse_prometheus",
    "parse_systems",
    "run_bench",
    "spread",
    "summarize_config",
    "write_json",
]
