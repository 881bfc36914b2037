"""The errors checkpoints raise (spec 9.4.6): each a `DTMError` with its spec code, naming
the checkpoint directory (`path`) and what was expected and found."""

from __future__ import annotations

from ..errors import DTMError, ErrorCode


class CheckpointError(DTMError):
    """Base of the checkpoint errors; `path` names the checkpoint root or step directory."""

    def __init__(self, code: ErrorCode, message: str, path: str | None = None):
        super().__init__(code, message)
        self.path = path


class _Coded(CheckpointError):
    """A checkpoint error of one code (`CODE`), made from its message and path."""

    CODE: ErrorCode
    PATH: str | None = None  # the path named when none is given

    def __init__(self, message: str, path: str | None = None):
        super().__init__(self.CODE, message, path if path is not None else self.PATH)


class NotACheckpoint(_Coded):
    """E1401: the path holds no complete checkpoint (or none of the step asked for)."""

    CODE = ErrorCode.NOT_A_CHECKPOINT


class CheckpointInvalid(_Coded):
    """E1403: a manifest that does not parse, exceeds its bound or contradicts itself."""

    CODE = ErrorCode.CHECKPOINT_INVALID


class CheckpointVersionError(_Coded):
    """E0601: a manifest of a newer major format version than this reader's."""

    CODE = ErrorCode.UNSUPPORTED_VERSION


class CheckpointExists(_Coded):
    """E1404: a save of a step that already has a complete checkpoint under the root."""

    CODE = ErrorCode.CHECKPOINT_EXISTS


class CheckpointBusy(_Coded):
    """E1407: a save into a root another process is saving into (its lock is held); names
    that process and the step it is saving."""

    CODE = ErrorCode.CHECKPOINT_BUSY


class NoSnapshot(_Coded):
    """E1405: load from "mem://" when this process holds no complete in-memory snapshot (or
    none of the step asked for), or when every one it holds lost a rank's pieces with all
    of their replicas; names the snapshots held and the ranks lost."""

    CODE, PATH = ErrorCode.NO_SNAPSHOT, "mem://"


class SnapshotFailed(_Coded):
    """E1406: a snapshot that did not complete on every rank (another rank failed, or the
    ranks' states differ); names the step and the ranks, and that the earlier snapshots
    are kept."""

    CODE, PATH = ErrorCode.SNAPSHOT_FAILED, "mem://"


class CheckpointChunkError(CheckpointError):
    """E1102: a chunk of a saved tensor that is missing, truncated or fails its CRC32C;
    `tensor`, `chunk` and `file` name it."""

    def __init__(self, tensor: str, chunk: str, file: str, why: str):
        super().__init__(ErrorCode.STORE_CHUNK_CORRUPT, f"tensor {tensor!r}, chunk {chunk!r} ({file}): {why}; "
                         "nothing was loaded", file)
        self.tensor, self.chunk, self.file = tensor, chunk, file


class CheckpointKeyError(CheckpointError, KeyError):
    """E1402: with strict=True, names the state has that the checkpoint lacks (`missing`)
    and names the checkpoint has that the state lacks (`unexpected`), as torch's
    load_state_dict lists them."""

    def __init__(self, missing: list[str], unexpected: list[str], path: str):
        super().__init__(ErrorCode.CHECKPOINT_KEYS, f"the state does not match the checkpoint {path}: missing keys "
                         f"{missing}, unexpected keys {unexpected} (strict=False loads the keys both hold); nothing "
                         "was loaded", path)
        self.missing, self.unexpected = missing, unexpected

    def __str__(self) -> str:  # (KeyError's would quote the message)
        return DTMError.__str__(self)


class CheckpointTypeError(CheckpointError, TypeError):
    """E0402 / E0403: a saved tensor whose dtype or shape is not the live tensor's."""

    def __init__(self, code: ErrorCode, tensor: str, expected: str, found: str, path: str):
        what = "dtype" if code is ErrorCode.DTYPE_MISMATCH else "shape"
        super().__init__(code, f"tensor {tensor!r}: the state expects {what} {expected}, the checkpoint {path} holds "
                         f"{found}; nothing was loaded", path)
        self.tensor, self.expected, self.found = tensor, expected, found
