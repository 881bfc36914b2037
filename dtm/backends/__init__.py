"""Backends (layer 3): each lowers the shared compiler's loop IR (dtm/compiler) into kernels
for one kind of device and builds them. `cpu` (C through the system compiler) is the one
there is; the runtime (dtm/runtime/backend.py) names backends and runs their programs."""
