"""Layer 3: IR-to-IR passes (DESIGN.md). Import the pass you need, e.g.
`from dtm.compiler.autodiff import grad`.

The cpu lowering (passes.py lists it; dtm/runtime/cpu.py runs its result):

    decompose.py   composites into primitives (the spec's normative decompositions)
    simplify.py    identities, constant folding, CSE, dead code
    schedule.py    fusion: which values are stored, which kernel computes each (`fuse`)
    views.py       movement ops as index arithmetic and strided views
    lower.py       groups -> loop-IR kernels (`lower_loops`), over buffers (program.py)
    loopir.py      the loop IR: loops, index expressions, loads, stores, accumulators
    memory.py      memory slots for temporaries, in-place kernels (`plan_memory`)
    render_c.py    loop IR -> C (`render_kernel`, `render_unit`)
    c_runtime.py   the C runtime library: tiled matrix products
    c_move.py      gather / dynamic_slice / dynamic_update_slice as row copies, the launch loop
    build.py       the C compiler, the on-disk kernel cache, loading with ctypes

gather, dynamic_slice and dynamic_update_slice (any dtype) are move steps, run by c_move.py.
Other ops on f16, bf16, f8 and quantized dtypes, and the ops without a loop lowering
(scatter_add, argsort, random, collectives, p2p, store, call, assign) run through the
reference implementation as fallback kernels.
"""
