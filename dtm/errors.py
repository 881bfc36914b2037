"""Every error a user sees: one enum of codes (mirrored by the spec's error table) and the
`DTMError` family that carries them.

The spec's table (docs/spec/dtm-spec.md, "Error codes") and `ErrorCode` are kept equal by
tests/test_spec.py. Codes are stable strings: an implementation in another language reports
the same code for the same fault.
"""

from __future__ import annotations

import copy
import enum
import os
import sys

_DTM_DIR = os.path.dirname(os.path.abspath(__file__))
# Standard-library code that calls a Tensor's protocol methods for the user (copy.deepcopy):
# the user's line is the one that called it.
_PROTOCOL_FILES = {copy.__file__}


class ErrorCode(str, enum.Enum):
    """Stable error codes. The first two digits name the area, the last two the fault."""

    # E01xx: reading text (lexical and syntax)
    INVALID_CHARACTER = "E0101"
    UNEXPECTED_TOKEN = "E0102"
    UNTERMINATED_STRING = "E0103"
    INVALID_NUMBER = "E0104"
    INVALID_HEADER = "E0105"
    INPUT_TOO_LARGE = "E0106"
    NESTING_TOO_DEEP = "E0107"
    INVALID_UTF8 = "E0108"
    INVALID_STRING = "E0109"
    # E02xx: names and SSA
    UNDEFINED_VALUE = "E0201"
    REDEFINED_VALUE = "E0202"
    UNDEFINED_FUNC = "E0203"
    DUPLICATE_SYMBOL = "E0204"
    UNDEFINED_MESH = "E0205"
    USE_BEFORE_DEF = "E0206"
    USE_AFTER_ASSIGN = "E0207"
    UNDEFINED_TASK = "E0208"
    TASK_CYCLE = "E0209"
    CALL_CYCLE = "E0210"
    INVALID_NAME = "E0211"
    # E03xx: ops and attributes
    UNKNOWN_OP = "E0301"
    OPERAND_COUNT = "E0302"
    MISSING_ATTRIBUTE = "E0303"
    UNKNOWN_ATTRIBUTE = "E0304"
    ATTRIBUTE_TYPE = "E0305"
    ATTRIBUTE_VALUE = "E0306"
    RESULT_COUNT = "E0307"
    # E04xx: types and shapes
    UNKNOWN_DTYPE = "E0401"
    DTYPE_MISMATCH = "E0402"
    SHAPE_MISMATCH = "E0403"
    RESULT_TYPE_MISMATCH = "E0404"
    INVALID_DIM = "E0405"
    RANK_MISMATCH = "E0406"
    RETURN_MISMATCH = "E0407"
    QUANTIZED_MISUSE = "E0408"
    UNBOUND_SYMBOL = "E0409"
    LITERAL_MISMATCH = "E0410"
    # E05xx: meshes and shardings
    UNKNOWN_MESH_AXIS = "E0501"
    SHARD_DIM_OUT_OF_RANGE = "E0502"
    DIM_SHARDED_TWICE = "E0503"
    PLACEMENT_COUNT = "E0504"
    INVALID_MESH = "E0505"
    INVALID_GROUP = "E0506"
    INVALID_PLACEMENT = "E0507"
    MESH_MISMATCH = "E0508"
    MESH_TOO_LARGE = "E0509"
    # E06xx: versions
    UNSUPPORTED_VERSION = "E0601"
    OP_NEWER_THAN_TARGET = "E0602"
    # E07xx: canonical binary encoding
    BAD_ENCODING = "E0701"
    TRUNCATED_ENCODING = "E0702"
    LIMIT_EXCEEDED = "E0703"
    # E08xx: running programs
    UNKNOWN_BACKEND = "E0801"
    TIMEOUT = "E0802"
    COLLECTIVE_MISMATCH = "E0803"
    STORE_KEY_MISSING = "E0804"
    READ_ONLY_INPUT = "E0805"
    BUILD_FAILED = "E0806"
    GRAPH_FREED = "E0807"
    INDEX_OUT_OF_RANGE = "E0808"
    DIVISION_BY_ZERO = "E0809"
    OUT_OF_MEMORY = "E0810"
    MEMORY_QUOTA_EXCEEDED = "E0811"
    # E09xx: the wire protocol
    BAD_MAGIC = "E0901"
    UNSUPPORTED_PROTOCOL_VERSION = "E0902"
    UNKNOWN_MESSAGE = "E0903"
    FRAME_TOO_LARGE = "E0904"
    TRUNCATED_FRAME = "E0905"
    CHECKSUM_MISMATCH = "E0906"
    STALE_EPOCH = "E0907"
    OUT_OF_SEQUENCE = "E0908"
    AUTH_FAILED = "E0909"
    BAD_PAYLOAD = "E0910"
    UNEXPECTED_MESSAGE = "E0911"
    # E10xx: membership and collectives between processes
    PEER_LOST = "E1001"
    COLLECTIVE_ABORTED = "E1002"
    RECEIVE_BUFFER_FULL = "E1003"
    JOIN_REFUSED = "E1004"
    NOT_INITIALIZED = "E1005"
    MISSING_CAPABILITY = "E1006"
    JOB_CANCELLED = "E1007"
    TENSOR_CHECKSUM_MISMATCH = "E1008"
    RESIZE = "E1009"
    RESIZE_FAILED = "E1010"
    # E11xx: the tensor store
    INVALID_STORE_KEY = "E1101"
    STORE_CHUNK_CORRUPT = "E1102"
    STORE_QUOTA_EXCEEDED = "E1103"
    STORE_IO_ERROR = "E1104"
    STORE_CORRUPT = "E1105"
    STORE_KEY_LOST = "E1106"
    STORE_INDEX_LOST = "E1107"
    # E12xx: task graphs
    TASK_FAILED = "E1201"
    WORKER_LOST = "E1202"
    TASK_CANCELLED = "E1203"
    TASK_NOT_IMPORTABLE = "E1204"
    # E13xx: data ingest and loading
    INGEST_INPUT_MISSING = "E1301"
    INGEST_FN_FAILED = "E1302"
    INGEST_WORKER_LOST = "E1303"
    INGEST_FN_NOT_IMPORTABLE = "E1304"
    DATA_MANIFEST_MISSING = "E1305"
    DATA_MANIFEST_INVALID = "E1306"
    DATA_TOO_SMALL = "E1307"
    # E14xx: checkpoints (spec 9.4)
    NOT_A_CHECKPOINT = "E1401"
    CHECKPOINT_KEYS = "E1402"
    CHECKPOINT_INVALID = "E1403"
    CHECKPOINT_EXISTS = "E1404"
    NO_SNAPSHOT = "E1405"
    SNAPSHOT_FAILED = "E1406"
    CHECKPOINT_BUSY = "E1407"

    def __str__(self) -> str:
        return self.value


class DTMError(Exception):
    """Base of every error DTM raises on purpose. `code` is an `ErrorCode`."""

    code: ErrorCode

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"

    def in_context(self, prefix: str) -> "DTMError":
        """This error, of the same class and with the same fields, its message led by
        `prefix` (where an executor met it: "@main op 3 (gather)")."""
        message = f"{prefix}: {self.message}"
        e = type(self).__new__(type(self), message)  # (copy.copy would call __init__ with args alone)
        e.__dict__.update(self.__dict__, message=message)
        return e


class TensorError(DTMError):
    """A mistake in tensor code (shape, dtype, argument), reported at the user's own line:
    `where` is "file:line" of the first frame outside the dtm package."""

    def __init__(self, code: ErrorCode, message: str, where: str | None = None):
        super().__init__(code, message)
        self.where = where

    def __str__(self) -> str:
        return (f"{self.where}: " if self.where else "") + f"{self.code.value}: {self.message}"


class TensorIndexError(TensorError, IndexError):
    """An index out of range in tensor code; an IndexError too, as torch's and Python's are,
    so `except IndexError` written for torch keeps working."""


class TensorZeroDivisionError(TensorError, ZeroDivisionError):
    """Integer division by zero in tensor code; a ZeroDivisionError too, as Python's is."""


class TensorTypeError(TensorError, TypeError):
    """An operand of a kind no tensor op takes (a string, a dict); a TypeError too, as
    Python's and torch's are."""


# The Python exception a tensor-code error also is, where the code has one.
_PYTHON_KIND: dict[ErrorCode, type[TensorError]] = {
    ErrorCode.INDEX_OUT_OF_RANGE: TensorIndexError,
    ErrorCode.DIVISION_BY_ZERO: TensorZeroDivisionError,
}


def user_line() -> str | None:
    """"file:line" of the innermost frame outside the dtm package: the user's own code."""
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith(_DTM_DIR) or f.f_code.co_filename in _PROTOCOL_FILES):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else None


def tensor_error(code: ErrorCode, message: str, where: str | None) -> TensorError:
    """A fault of the user's tensor code found at `where` ("file:line"), of the Python
    exception kind the code has (an IndexError for an index out of range)."""
    return _PYTHON_KIND.get(code, TensorError)(code, message, where)


def user_error(code: ErrorCode, message: str) -> TensorError:
    """A mistake in the user's tensor code, reported at the user's own line."""
    return tensor_error(code, message, user_line())
