"""Task graphs (spec 9.3): functions whose inputs and outputs are keys in the tensor store,
ordered by `after`, run by a local scheduler or on Ray (`backend="ray"`, rayrun.py).

    g = dtm.tasks.Graph(store=st)
    tok = g.task(tokenize, inputs=["raw/0"], outputs=["tok/0"], process=True)  # a worker process
    emb = g.task(embed, inputs=["tok/0", "w/emb"], outputs=["x/0"], after=[tok])  # a thread, jitted
    run = g.run(workers=2)             # returns at once
    run.wait(timeout=60); run.status(); run.cancel(); run.report()

Only `after` orders tasks; a task that reads a key another writes must name it there.
A task function takes one dtm Tensor per input key and returns one per output key (a
tuple, or one Tensor). Thread tasks (the default) suit compiled DTM code, which releases
the GIL; `process=True` tasks run on worker processes, which import the function by name,
so it must be a module-level function of an importable module. Results travel through the
store, never pickled. A task that raises fails the run with its error (naming the task,
its inputs and its worker); a task whose worker process died is run again, up to
`retries` times. `Graph.from_module` runs an IR module's `task` declarations (and
`dtm tasks run module.dtm --store DIR` on the command line).

Layer: row 8 of docs/architecture.md's table. Tensors and dtm.jit come through `install`, which
`dtm/__init__.py` calls, as the store's `get` gets its Tensor factory.
"""

from .errors import Cancelled, GraphError, TaskError, TaskFailed, TaskTimeout, WorkerLost
from .functions import IRFunction, install
from .graph import Graph, Task
from .report import Report, TaskRecord

__all__ = ["Graph", "Task", "IRFunction", "Report", "TaskRecord", "TaskError", "TaskFailed", "TaskTimeout",
           "WorkerLost", "Cancelled", "GraphError", "install"]
