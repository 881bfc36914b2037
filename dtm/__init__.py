"""DTM, the Distributed Tensor Machine: write a tensor program once and run it on one
device, many devices, or many hosts. `dtm.ir` is the language-agnostic IR every layer
shares; see README.md for the tour and docs/spec/dtm-spec.md for the normative spec."""

from . import ir
from .errors import DTMError, ErrorCode
from .ir.version import PACKAGE_VERSION as __version__

__all__ = ["ir", "DTMError", "ErrorCode", "__version__"]
