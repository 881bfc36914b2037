"""Layer 4: DTM's wire protocol (spec 9.1) as bytes in, bytes out; it never opens a socket.

- `errors`: `ProtocolError` (codes E09xx), `ChecksumError`, `StaleEpochError`;
- `frame`: the 40-byte frame header, CRC32C, `FrameDecoder`;
- `payload`: the field primitives every message payload is built from;
- `caps`: conformance levels and the CAP_* bits a Hello announces;
- `messages`: one dataclass per message type, `encode_message` / `decode_message`;
- `handshake`: version negotiation, HMAC challenge and answer, the `Handshake` state machine;
- `conformance`: the runner of `conformance/protocol/`.
"""

from .errors import ChecksumError, ProtocolError, StaleEpochError
from .frame import (EPOCH_EXEMPT, FLAG_COMPRESSED, FLAG_LAST, FLAG_RELAYED, HEADER_SIZE, MAGIC, MAX_PAYLOAD, PROTOCOL_VERSION,
                    FrameDecoder, FrameHeader, MsgType, decode_header, encode_frame, encode_header, verify_payload)
from .caps import Cap, cap_names, level_caps
from .messages import (DATA_HEADER_SIZE, MESSAGES, Cancel, CollectiveStart, Data, Error, Heartbeat, Hello, JoinMesh,
                       Leave, Member, MeshView, Message, P2PSend, WorkerRow, decode_message, encode_message,
                       frame_parts)
from .handshake import SPOKEN, Handshake, check_answer, hmac_answer, negotiate

__all__ = [
    "ProtocolError", "ChecksumError", "StaleEpochError",
    "MAGIC", "HEADER_SIZE", "MAX_PAYLOAD", "PROTOCOL_VERSION", "FLAG_LAST", "FLAG_COMPRESSED", "FLAG_RELAYED", "EPOCH_EXEMPT",
    "MsgType", "FrameHeader", "encode_header", "encode_frame", "decode_header", "verify_payload", "FrameDecoder",
    "Cap", "cap_names", "level_caps",
    "Message", "Hello", "JoinMesh", "Member", "MeshView", "Heartbeat", "WorkerRow", "Leave", "CollectiveStart", "Data",
    "P2PSend", "Error", "Cancel", "MESSAGES", "DATA_HEADER_SIZE", "frame_parts", "encode_message", "decode_message",
    "SPOKEN", "Handshake", "negotiate", "hmac_answer", "check_answer",
]
