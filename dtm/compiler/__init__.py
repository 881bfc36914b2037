"""Layer 3: IR-to-IR passes (DESIGN.md). Import the pass you need, e.g.
`from dtm.compiler.autodiff import grad`."""
