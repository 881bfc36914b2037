"""Shared test set-up: programs that run store_get / store_put without a store of their own
use the process's store (spec 9.2); in tests that is a process-local memory:// store, so no
test writes the user's default store (~/.cache/dtm/store) or sees what it holds. Processes
the tests start inherit the variable and get memory stores of their own."""

import os

os.environ["DTM_STORE"] = "memory://tests"
