"""The cuda backend (layer 3, beside dtm/backends/cpu): the fused loop IR rendered as CUDA C
(`render_cuda.py`, the C renderer's expressions with a GPU's schedule), compiled to PTX by
NVRTC (dtm/toolchain/nvrtc.py), the lowering as one flat list (`passes.py`). It compiles
on any machine; running its kernels needs a GPU and the executor that launches them, which
is not written yet: `device="cuda"` fails loudly (dtm/backends/gpu_probe.py)."""
