"""Live resize against torchelastic's restart, in the same run on the same machine.

    python benchmarks/elastic.py [--model char|gpt2] [--steps N] [--skip-torch]

DTM: the char GPT (tests/elastic_train.py; `--model gpt2`: GPT-2 124M on random tokens, 4
rows of 64 a step, as the peer's) with DP=2 x TP=2 over 4 processes under
`dtm launch --elastic 2:8`; the process of rank 3 SIGKILLs itself at the start of step 4
(the others are then in that step's collectives), the survivors shrink to DP=1 x TP=2 and
redo the step; two ranks join with `dtm launch --join` and the mesh grows back to
DP=2 x TP=2. Measured from the step lines' wall-clock times:
- shrink: from the SIGKILL to the next step the survivors complete;
- grow: from the joiners' start (their processes included: Python, numpy, dtm) to the first
  step the grown mesh completes, and from their admission (the resize) to it;
- steps lost: the steps redone after the kill.
torchelastic (benchmarks/elastic_torch.py): the same model under torchrun with DDP over
gloo, DCP saved after every step; a killed worker makes torchrun restart all four, which
load the last checkpoint. A join is a second torchrun agent (--nnodes 1:2), which restarts
every worker too. The figures are single runs on a shared 2-core machine: rerun them.

Both engines' processes start as on a user's machine: with Python's bytecode caches
written and warm (`bytecode_as_users_have_it`). A shell with PYTHONDONTWRITEBYTECODE=1 (as
this project's VMs have) makes every process of an editable install compile DTM's 258
modules again (0.6 s of `import dtm`, against 0.3 s), while torch's pip-installed bytecode is
read as usual: a start measured so is not the user's.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
SCRIPT = str(ROOT / "tests" / "elastic_train.py")
DTM = str(pathlib.Path(sys.executable).parent / "dtm")
STEP = re.compile(r"epoch (\d+) rank (\d+)/(\d+) .* step (\d+) loss (\S+) t=([\d.]+)")


def _follow(cmd: list[str], lines: queue.Queue) -> subprocess.Popen:
    env = dict(os.environ, DTM_HEARTBEAT_MS="200", DTM_HEARTBEAT_TIMEOUT_MS="3000")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def read() -> None:
        for line in p.stdout:
            lines.put((time.time(), line))
            print("   ", line.rstrip(), flush=True)  # long work shows progress

    threading.Thread(target=read, daemon=True).start()
    return p


def bytecode_as_users_have_it(skip_torch: bool) -> None:
    """Let this benchmark's processes write Python's bytecode caches, and write them now
    (one import of each engine), so that every measured start reads them."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    warm = "import dtm" + ("" if skip_torch else "; import torch, torch.distributed.checkpoint")
    subprocess.run([sys.executable, "-c", warm], check=True, cwd=ROOT)


def measure_dtm(steps: int, model: str = "char", timeout: float = 900) -> dict:
    """One elastic run (module doc): the shrink's and the grow's seconds, steps lost."""
    lines: queue.Queue = queue.Queue()
    out = pathlib.Path(tempfile.mkdtemp(prefix="dtm-elastic-bench-")) / "losses.json"
    # the char model's steps take milliseconds: each waits 0.3 s, so that joiners come in mid-run
    train = [SCRIPT, "--steps", str(steps), "--model", model, "--sleep", "0.3" if model == "char" else "0"]
    job = _follow([DTM, "launch", "-n", "4", "--axes", "dp=2,tp=2", "--elastic", "2:8", *train, "--kill", "3:4",
                   "--out", str(out)], lines)
    deadline = time.monotonic() + timeout
    killed = joined = admitted = address = None
    shrink = grow = None
    admitted_to_step = float("nan")
    redone: set[int] = set()
    done_before: set[int] = set()
    joiners = None
    while time.monotonic() < deadline and (shrink is None or grow is None):
        try:
            seen, line = lines.get(timeout=0.5)
        except queue.Empty:
            if job.poll() is not None:
                break
            continue
        if line.startswith("[rank 0] coordinator "):
            address = line.split()[-1]
        if "killing myself at t=" in line:
            killed = float(line.rsplit("t=", 1)[1])
        if "mesh resized to epoch 2" in line and joiners is None:
            joined = time.time()
            joiners = _follow([DTM, "launch", "--join", address, "-n", "2", *train], lines)
        if "mesh resized to epoch 3" in line:
            admitted = seen
        m = STEP.search(line)
        if m is None:
            continue
        epoch, step, t = int(m[1]), int(m[4]), float(m[6])
        if epoch == 1 and m[5] != "nan":  # (a NaN loss is the step the kill broke: it is redone, not done)
            done_before.add(step)
        if killed is not None and epoch == 2:
            redone.add(step)
            if shrink is None:
                shrink = t - killed
        if epoch == 3 and grow is None and joined is not None:
            grow = t - joined
            admitted_to_step = t - admitted if admitted is not None else admitted_to_step
    for p in (job, joiners):
        if p is not None:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    # completed steps whose work was lost: those done before the kill that had to be redone
    lost = max(done_before, default=-1) + 1 - min(redone) if redone else None
    return {"shrink_s": shrink, "grow_s": grow, "grow_after_admission_s": admitted_to_step,
            "steps_lost": lost, "redone_from": min(redone, default=None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("char", "gpt2"), default="char")
    ap.add_argument("--steps", type=int, default=None, help="steps of the DTM job (default: 24 char, 12 gpt2)")
    ap.add_argument("--skip-torch", action="store_true", help="DTM alone (torchrun and torch not needed)")
    args = ap.parse_args()
    steps = args.steps or (24 if args.model == "char" else 12)
    bytecode_as_users_have_it(args.skip_torch)
    print(f"DTM ({args.model}): dtm launch -n 4 --axes dp=2,tp=2 --elastic 2:8, rank 3 killed at step 4, 2 ranks "
          "join", flush=True)
    d = measure_dtm(steps, args.model)
    missing = [what for what, key in (("shrink", "shrink_s"), ("grow", "grow_s")) if d[key] is None]
    if missing:  # (the job ended, or the run timed out, before the step that measures it)
        sys.exit(f"DTM: no {' or '.join(missing)} measured: the job's lines above show how far it got; a grow "
                 f"needs the joiners admitted before the last step (--steps {steps}: give more)")
    print(f"DTM  shrink (SIGKILL -> next step done) {d['shrink_s']:.2f} s; grow (joiners started -> first step of "
          f"the grown mesh) {d['grow_s']:.2f} s, of which after admission {d['grow_after_admission_s']:.2f} s; "
          f"redone from step {d['redone_from']} (steps of work lost: {d['steps_lost']})", flush=True)
    if args.skip_torch:
        return
    sys.path.insert(0, str(HERE.parent))
    import elastic_torch

    print("torchelastic: torchrun --nproc-per-node 4 --max-restarts 1, DDP/gloo, DCP every step", flush=True)
    r = elastic_torch.measure_restart(args.model)
    g = elastic_torch.measure_grow(args.model)
    shrink_t, grow_t = r["kill_to_first_step_all"], g["join_to_first_step"]
    print(f"torchelastic: restart after SIGKILL {shrink_t:.2f} s (steps lost {r['steps_lost']}); grow (second "
          f"agent started -> first step of the grown job) {grow_t:.2f} s", flush=True)
    print(f"ratio (torchelastic / DTM): shrink {shrink_t / d['shrink_s']:.1f}x, grow {grow_t / d['grow_s']:.1f}x")


if __name__ == "__main__":
    main()
