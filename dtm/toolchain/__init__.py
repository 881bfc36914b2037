"""The toolchain (layer 1.5): C sources compiled into shared objects and cached on disk by
content hash (`cc.py`), the cache kept within its bound (`kernel_cache.py`). It knows
nothing of what a kernel computes: the backends (dtm/backends) render the C, comm its pumps."""

from .cc import (BASE_FLAGS, COMPILE_TIMEOUT, STATS, BuildError, build, cache_dir, compiler, compiler_offers,
                 compiler_version, load, made, native_target)

__all__ = ["BuildError", "build", "load", "compiler", "compiler_version", "compiler_offers", "native_target",
           "cache_dir", "made", "STATS", "BASE_FLAGS", "COMPILE_TIMEOUT"]
