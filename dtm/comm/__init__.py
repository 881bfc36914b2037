"""Layer 5: collectives and point-to-point transfers between ranks (spec 3.11, 3.12, 9.5).

- `transport`: the `Transport` interface (frames to and from peers) and this layer's errors;
- `algorithms`: ring, recursive doubling, trees and direct exchange over a Transport (reducing with
  `dtm.ref.reduction`, the one table of reduce ops: narrow floats in f32, rounded once);
- `calls`: collective descriptors (CollectiveStart): encoding, comparison, messages;
- `collectives`: `Communicator`, the collectives and send/recv, with desync detection;
- `inproc`, `tcp`, `shm`: the transports (threads of one process, hosts, ranks of one host).
"""

from .collectives import Communicator
from .inproc import InprocHub, InprocTransport
from .shm import ShmTransport, connect_local
from .tcp import TcpTransport, connect_mesh, listen
from .transport import CollectiveAborted, CollectiveMismatch, PeerLost, Transport

__all__ = ["Communicator", "Transport", "InprocHub", "InprocTransport", "TcpTransport", "ShmTransport", "listen",
           "connect_mesh", "connect_local", "PeerLost", "CollectiveMismatch", "CollectiveAborted"]
