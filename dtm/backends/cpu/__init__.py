"""The cpu backend (layer 3, beside dtm/compiler): the fused loop IR rendered as C
(`render_c.py`, with the C of its runtime libraries: `c_runtime.py` the products,
`c_narrow.py` narrow weights, `c_bf16.py` bf16 products, `c_move.py` the movement steps and
the launch loop, `c_convert.py` and `c_random.py` pieces of kernels), memory planned for
its temporaries (`memory.py`), built by the system C compiler (`build.py`, through
dtm/toolchain), the whole lowering as one flat list (`passes.py`). dtm/runtime/cpu.py runs
what it compiles."""
