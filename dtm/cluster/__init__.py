"""Layer 6: membership of a multi-process mesh (spec 9.6).

- `env`: the DTM_* environment variables a rank starts from;
- `conn`: one control connection's framing (handshake, numbering, epochs);
- `coordinator`: admits ranks, assigns ranks and the epoch, publishes the MeshView, detects
  lost ranks from heartbeats and tells the others;
- `membership`: a rank's side: join, then a heartbeat thread that hears of lost peers;
- `heartbeat`: what a heartbeat reports, how often, and the failure-detection bound;
- `launch`: `dtm launch`, N local ranks as subprocesses;
- `cancel`: the cancel of a whole job (spec 9.4.10): `Cancelled` (E1007) and its notice.
"""

from .coordinator import Coordinator
from .env import RankEnv, parse_address, parse_axes, rank_env
from .heartbeat import HEARTBEAT_MS, TIMEOUT_MS, Figures, detection_bound
from .launch import launch
from .membership import Membership, join

__all__ = ["Coordinator", "Membership", "join", "launch", "RankEnv", "rank_env", "parse_address", "parse_axes",
           "Figures", "HEARTBEAT_MS", "TIMEOUT_MS", "detection_bound"]
