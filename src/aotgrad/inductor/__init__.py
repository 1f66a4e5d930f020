"""Inductor as aotgrad's graph compiler.

Takes aotgrad's forward/backward/inference graphs and a backend's `mode=` / `options=`; returns
Inductor-compiled callables (`compile_fx_inner` per graph, Inductor's decompositions and passes).
`context.py` holds the compile context shared with the cache and the backend, and
`BackendCompileError`; `cudagraphs.py` what Inductor's CUDA graphs need from aotgrad (static inputs,
a backward sharing its forward's choice) and why a graph runs without them. `donation.py` lets the
backward write into saved intermediates nothing else holds (upstream's donated buffers). `isa_probe.py` runs
Inductor's per-process CPU ISA probe in a thread while aotgrad loads or traces. `cpu_scatter.py`
sends the accumulating CPU scatters that Inductor's C++ tiling would misaddress to aten, and
`avg_pool_backward.py` the ceil-mode average-pool backwards it would divide wrongly (both through
`reroute.py`). Sits below `cache/` (which reloads Inductor's code) and `backend/`.
"""
