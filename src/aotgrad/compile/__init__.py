"""Stage 4, compile: hand each graph to the user's compiler (boxed convention).

Takes the partitioned graphs and the user's `fw_compiler` / `bw_compiler` / `inference_compiler`;
returns `CompiledForward` (boxed forward now, backward compiled lazily on first use). Decides what
the compilers see: functional graphs, custom mutable ops re-inplaced (`compile/reinplace.py`), input
mutations kept in the graph where asked, a backward per set of outputs without gradient.
`compile/compilers.py` holds the compilers users know by their functorch names (`nop`, `print_compile`, ...).
"""
