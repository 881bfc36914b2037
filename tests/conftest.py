"""Shared test set-up: programs that run store_get / store_put without a store of their own
use the process's store (spec 9.2); in tests that is a process-local memory:// store, so no
test writes the user's default store (~/.cache/dtm/store) or sees what it holds. Processes
the tests start inherit the variable and get memory stores of their own. DTM_DEBUG=verify
too (below)."""

import os

os.environ["DTM_STORE"] = "memory://tests"

# Every compiler pass's output verified, not only the program a compile starts from (the
# default: dtm/compiler/irutil.py's verify_pass): a pass that makes bad IR fails at that pass.
os.environ["DTM_DEBUG"] = ",".join(sorted({f for f in os.environ.get("DTM_DEBUG", "").split(",") if f} | {"verify"}))
