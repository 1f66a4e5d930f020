"""Inductor as aotgrad's graph compiler.

Takes aotgrad's forward/backward/inference graphs and a backend's `mode=` / `options=`; returns
Inductor-compiled callables (`compile_fx_inner` per graph, Inductor's decompositions and passes).
`context.py` holds the compile context shared with the cache and the backend, and
`BackendCompileError`. Sits below `cache/` (which reloads Inductor's code) and `backend/`.
"""
