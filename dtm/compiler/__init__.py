"""Layer 3: IR-to-IR passes (docs/architecture.md). Import the pass you need, e.g.
`from dtm.compiler.autodiff import grad`.

The lowering every backend shares (passes.py lists it; a backend, dtm/backends/cpu,
continues it into kernels of its own, and dtm/runtime/cpu.py runs the result):

    decompose.py   composites into primitives (the spec's normative decompositions)
    simplify.py    identities, constant folding, CSE, dead code
    schedule.py    fusion: which values are stored, which kernel computes each (`fuse`)
    views.py       movement ops as index arithmetic and strided views
    lower.py       groups -> loop-IR kernels (`lower_loops`), over buffers (program.py)
    loopir.py      the loop IR: loops, index expressions, loads, stores, accumulators
    share.py       kernels that differ only in integer literals share a body

gather, dynamic_slice and dynamic_update_slice (any dtype) are move steps (the cpu backend's
c_move.py).
Other ops on f16, bf16, f8 and quantized dtypes, and the ops without a loop lowering
(scatter_add, argsort, random, collectives, p2p, store, call, assign) run through the
reference implementation as fallback kernels.
"""
