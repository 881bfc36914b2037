"""Layer 5: collectives and point-to-point transfers between ranks (spec 3.11, 3.12, 9.5).

- `transport`: the `Transport` interface (frames to and from peers) and the errors of this layer;
- `algorithms`: ring, recursive doubling, trees and direct exchange over a Transport;
- `reduction`: the reductions, with narrow floats in f32 and one rounding;
- `collectives`: `Communicator`, the collectives and send/recv with desync detection;
- `inproc`, `shm`, `tcp`: the transports (threads of one process, processes of one host, hosts).
"""

from .collectives import Communicator
from .inproc import InprocHub, InprocTransport
from .transport import CollectiveAborted, CollectiveMismatch, PeerLost, Transport

__all__ = ["Communicator", "Transport", "InprocHub", "InprocTransport", "PeerLost", "CollectiveMismatch",
           "CollectiveAborted"]
