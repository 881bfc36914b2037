"""The torchelastic way of surviving a lost worker, measured on this machine: the peer that
benchmarks/elastic.py compares DTM against.

torchelastic (torchrun) does not repair a job in place: on any membership change (a worker
dies, a node joins) its agent stops every worker, starts them all again, and each new worker
loads the last checkpoint it finds. So a job survives a lost worker only as well as its
checkpoints: here a `torch.distributed.checkpoint` (DCP) of model + AdamW state + step after
every step, the cheapest recovery torchelastic allows (nothing but the step in flight is
lost), and its cost is paid on every step.

The job: 4 worker processes under `torchrun --standalone --nnodes 1 --nproc-per-node 4
--max-restarts 1`, one CPU thread each, training transformers' GPT2LMHeadModel under
torch.nn.parallel.DDP over gloo:
- char: 2 layers, 4 heads, 48 wide, context 32, vocabulary 65 (DTM's char GPT), batch 8 per rank;
- gpt2: GPT-2 124M (the default GPT2Config), random init, batch 1 x 64 tokens per rank.
Each step's batch (and dropout) is drawn from torch's generator seeded with the step and the
rank, so a redone step sees the same tokens and masks. After a step and its checkpoint, every rank appends
`rank step time.time()` to steps.log in the run's folder (events.log has the rest: worker
start, torch and transformers imported, process group up, model built, checkpoint loaded, each save's
seconds, each step's loss).

`measure_restart` runs the job in a network namespace with only loopback (gloo tries the
machine's other interfaces otherwise), SIGKILLs rank 1 once it has completed `kill_step`,
and returns: seconds from the kill to the first step the restarted workers complete (on any
rank and on all ranks), how that splits (the agent noticed and started new workers, they
imported torch, set up the process group, built the model, loaded the checkpoint), the steps of work lost, the time of one normal step and of its DCP save,
and torchrun's exit status.

    python benchmarks/elastic_torch.py [--model char|gpt2] [--kill-step 3] [--steps 8] [--timeout 600]

`measure_grow` (--grow) is the other half: a second torchrun agent joins a running job
(`--nnodes 1:2`, c10d rendezvous on 127.0.0.1; --nproc workers each, after --kill-step), and
returns the seconds from its start to the first step of the grown job, split the same way.

    python benchmarks/elastic_torch.py --grow [--model char] [--nproc 2] [--kill-step 3]

(It starts its own torchrun of itself with --worker.)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve()
NPROC = 4
MODELS = {  # GPT2Config fields, batch per rank, context
    "char": (dict(vocab_size=65, n_positions=32, n_embd=48, n_layer=2, n_head=4), 8, 32),
    "gpt2": ({}, 1, 64),
}
LR = 3e-4
NETNS = 'ip link set lo up && exec "$@"'  # run in `unshare -n`: loopback up, then the command


# ---- the worker (run by torchrun) ----

def log(folder: pathlib.Path, name: str, line: str) -> None:
    """Append one line in one write (the ranks share the file)."""
    with open(folder / name, "a") as f:
        f.write(line + "\n")


def worker(model_name: str, steps: int, folder: pathlib.Path) -> None:
    """One rank: load the newest complete checkpoint if there is one, then train up to `steps`,
    checkpointing after every step."""
    started = time.time()
    rank = int(os.environ["RANK"])
    (folder / f"pid-{rank}").write_text(str(os.getpid()))
    log(folder, "events.log", f"{rank} start 0 {started}")

    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    log(folder, "events.log", f"{rank} imported 0 {time.time()}")
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    log(folder, "events.log", f"{rank} pg 0 {time.time()}")

    fields, batch, context = MODELS[model_name]
    config = GPT2Config(**fields)
    torch.manual_seed(0)
    model = DDP(GPT2LMHeadModel(config))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    log(folder, "events.log", f"{rank} built 0 {time.time()}")
    ckpts = folder / "ckpt"

    def state(step: int) -> dict:
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}

    resume = [None]
    if rank == 0:  # one rank decides which checkpoint, and clears the ones a kill left half-written
        ckpts.mkdir(exist_ok=True)
        for d in ckpts.glob("*.tmp"):
            shutil.rmtree(d)
        done = sorted(d for d in ckpts.iterdir() if d.name.startswith("step-") and not d.name.endswith(".tmp"))
        resume = [str(done[-1]) if done else None]
    dist.broadcast_object_list(resume, src=0)
    first = 1
    if resume[0] is not None:
        sd = state(0)
        dcp.load(sd, checkpoint_id=resume[0])
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        first = int(sd["step"]) + 1
        log(folder, "events.log", f"{rank} loaded {first - 1} {time.time()}")

    model.train()
    for step in range(first, steps + 1):
        torch.manual_seed(step * 1000 + rank)  # the same batch and dropout masks when a step is redone
        x = torch.randint(0, config.vocab_size, (batch, context))
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

        t0 = time.time()
        tmp, final = ckpts / f"step-{step:06d}.tmp", ckpts / f"step-{step:06d}"
        dcp.save(state(step), checkpoint_id=tmp)  # returns once every rank's part and the metadata are written
        if rank == 0:
            tmp.rename(final)  # a complete checkpoint is a folder without .tmp
            old = ckpts / f"step-{step - 2:06d}"
            if old.exists():
                shutil.rmtree(old)  # keep the last two
        dist.barrier()  # the step counts as completed once its checkpoint is there
        log(folder, "events.log", f"{rank} save {time.time() - t0} {time.time()}")
        log(folder, "events.log", f"{rank} loss{step} {loss.item()} {time.time()}")
        log(folder, "steps.log", f"{rank} {step} {time.time()}")
    # (not dist.destroy_process_group(): after a restart the new workers hung in it with
    # torch 2.13 and gloo, every step done, and the job never ended; the figures end at the
    # last step, so the workers simply exit)
    os._exit(0)


# ---- the driver ----

def read_lines(path: pathlib.Path) -> list[list[str]]:
    """The complete lines of a log so far, split."""
    if not path.exists():
        return []
    text = path.read_text()
    return [line.split() for line in text[:text.rfind("\n") + 1].splitlines()]


def steps_of(folder: pathlib.Path) -> list[tuple[int, int, float]]:
    """(rank, step, time) of every completed step so far."""
    return [(int(r), int(s), float(t)) for r, s, t in read_lines(folder / "steps.log")]


def events_of(folder: pathlib.Path) -> list[tuple[int, str, float, float]]:
    """(rank, event, value, time) of every worker event so far."""
    return [(int(r), e, float(v), float(t)) for r, e, v, t in read_lines(folder / "events.log")]


def check_netns() -> None:
    """Raise, saying why, when this machine cannot make a loopback-only network namespace."""
    try:
        out = subprocess.run(["unshare", "-n", "sh", "-c", NETNS, "sh", "true"], capture_output=True,
                             text=True, timeout=30)
    except FileNotFoundError as e:
        raise RuntimeError("`unshare` is not installed: cannot give torchrun a loopback-only network") from e
    if out.returncode:
        raise RuntimeError("`unshare -n` failed (it needs root or user namespaces): cannot give torchrun a "
                           f"loopback-only network: {out.stderr.strip()}")


def stop(procs: list[subprocess.Popen], folder: pathlib.Path) -> None:
    """End the job: SIGTERM to the torchrun agents (which stop their workers), then SIGKILL to
    what is left (the workers are in sessions of their own, so by the pids they wrote)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for f in folder.glob("pid-*"):
        try:
            os.kill(int(f.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def torchrun(model: str, steps: int, folder: pathlib.Path, nproc: int, rendezvous: list[str]) -> list[str]:
    """The command line of one torchrun agent of the job."""
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", str(nproc),
            "--max-restarts", "1", str(HERE), "--worker", "--model", model, "--steps", str(steps), "--dir", str(folder)]


def start(cmd: list[str], log: pathlib.Path) -> subprocess.Popen:
    """Start a torchrun agent, its output to `log`."""
    # torchrun's workers share its rendezvous TCPStore by default, and the keys of gloo's
    # connectFullMesh outlive a restart: the restarted workers read the dead ones' addresses
    # and fail ("Connection refused", pytorch/pytorch#135712). Its opt-out gives each round
    # a store of its own.
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def measure_restart(model: str, kill_step: int = 3, steps: int = 8, timeout: float = 600) -> dict:
    """Run the job, SIGKILL rank 1 once it has completed `kill_step`, wait for the job to end
    (all within `timeout` seconds, the job killed past it) and return the figures (seconds,
    times from time.time()):
    kill_to_first_step_any / _all: from the kill to the first step the restarted workers
    complete, on any rank / on every rank; kill_to_workers_started, kill_to_imported,
    kill_to_pg_ready, kill_to_built, kill_to_loaded: from the kill to the last new worker's
    start, to its imports done, process group up, model and optimizer built, checkpoint
    loaded (each the last rank's); last_step_before_kill: the last step any rank completed before the kill;
    resumed_from: the checkpoint's step the restart loaded (it redoes resumed_from + 1 on);
    steps_lost: last_step_before_kill - resumed_from; step_s: the median time of a step
    (its DCP save included) on rank 0, from one step's end to the next's, before the kill and
    after the restart; save_s: the median DCP save (every rank, every step); exit_status: torchrun's."""
    if not 1 <= kill_step < steps:
        raise ValueError("kill_step must be in [1, steps)")
    check_netns()
    folder = pathlib.Path(tempfile.mkdtemp(prefix=f"elastic-torch-{model}-"))
    cmd = ["unshare", "-n", "sh", "-c", NETNS, "sh",
           *torchrun(model, steps, folder, NPROC, ["--standalone", "--nnodes", "1"])]
    deadline = time.time() + timeout
    print(f"[{model}] torchrun, {NPROC} workers, {steps} steps, run folder {folder}", flush=True)
    proc = start(cmd, folder / "torchrun.log")
    try:
        seen = 0
        while True:  # until rank 1 has completed kill_step
            done = max((s for r, s, _ in steps_of(folder) if r == 1), default=0)
            if done > seen:
                print(f"[{model}] rank 1 completed step {done} ({time.time() - (deadline - timeout):.1f} s)", flush=True)
                seen = done
            if done >= kill_step:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"torchrun ended ({proc.returncode}) before step {kill_step}:\n"
                                   + (folder / "torchrun.log").read_text()[-3000:])
            if time.time() > deadline:
                raise TimeoutError(f"rank 1 did not complete step {kill_step} in {timeout} s")
            time.sleep(0.01)
        pid = int((folder / "pid-1").read_text())
        os.kill(pid, signal.SIGKILL)
        killed = time.time()
        print(f"[{model}] SIGKILL to rank 1 (pid {pid}) after its step {kill_step}", flush=True)
        seen = 0
        while proc.poll() is None:
            after = [s for r, s, t in steps_of(folder) if t > killed]
            if len(after) > seen:
                print(f"[{model}] {len(after)} rank-steps completed since the kill, latest step {max(after)} "
                      f"({time.time() - killed:.1f} s after it)", flush=True)
                seen = len(after)
            if time.time() > deadline:
                raise TimeoutError(f"the job did not end in {timeout} s")
            time.sleep(0.05)
        print(f"[{model}] torchrun ended: {proc.returncode}", flush=True)
    except BaseException:
        stop([proc], folder)
        print((folder / "torchrun.log").read_text()[-3000:], file=sys.stderr)
        raise

    rows, events = steps_of(folder), events_of(folder)
    before = [(r, s, t) for r, s, t in rows if t <= killed]
    # the old workers may still log the step they were finishing at the kill: the restarted
    # ones' steps are those after each rank's new start
    restarted = {r: t for r, e, v, t in events if e == "start" and t > killed}
    after = [(r, s, t) for r, s, t in rows if r in restarted and t > restarted[r]]
    if len(restarted) < NPROC or {r for r, s, t in after} != set(range(NPROC)):
        raise RuntimeError("the restarted workers did not all complete a step:\n" + (folder / "torchrun.log").read_text()[-3000:])
    rank0 = [sorted(t for r, s, t in before if r == 0), sorted(t for r, s, t in after if r == 0)]
    loaded = [(v, t) for r, e, v, t in events if e == "loaded" and t > killed]

    def last_after(name: str) -> float:
        return max(t for r, e, v, t in events if e == name and t > killed) - killed

    figures = {
        "model": model,
        "kill_to_first_step_any": min(t for r, s, t in after) - killed,
        "kill_to_first_step_all": max(min(t for r, s, t in after if r == k) for k in range(NPROC)) - killed,
        "kill_to_workers_started": last_after("start"),
        "kill_to_imported": last_after("imported"),
        "kill_to_pg_ready": last_after("pg"),
        "kill_to_built": last_after("built"),
        "kill_to_loaded": last_after("loaded"),
        "last_step_before_kill": max(s for r, s, t in before),
        "resumed_from": int(loaded[0][0]),
        "steps_lost": max(s for r, s, t in before) - int(loaded[0][0]),
        "step_s": statistics.median(b - a for ts in rank0 for a, b in zip(ts, ts[1:])),
        "save_s": statistics.median(v for r, e, v, t in events if e == "save"),
        "exit_status": proc.returncode,
    }
    shutil.rmtree(folder)
    return figures


def measure_grow(model: str, nproc: int = 2, join_step: int = 3, steps_after: int = 3,
                 timeout: float = 600) -> dict:
    """Start the job on one torchrun agent of `nproc` workers that admits a second node
    (`--nnodes 1:2`, c10d rendezvous on 127.0.0.1), start a second agent of `nproc` workers
    once rank 0 has completed `join_step` (in the first one's network namespace), and stop
    both once the grown job has completed `steps_after` steps (all within `timeout` seconds).
    The first agent sees the second waiting, stops its workers and both start all 2 * nproc
    afresh, which load the last checkpoint. Returns (seconds, from the second agent's start):
    join_to_first_step: to the first step of the grown job; join_to_workers_started,
    join_to_imported, join_to_pg_ready, join_to_built, join_to_loaded: to the last new
    worker's start, imports done, process group up, model built, checkpoint loaded;
    last_step_before_join: the last step the old workers completed; resumed_from: the
    checkpoint's step the grown job loaded; steps_lost: the difference; step_s_before /
    step_s_after: the median step on rank 0 of the old and of the grown job."""
    check_netns()
    folder = pathlib.Path(tempfile.mkdtemp(prefix=f"elastic-torch-grow-{model}-"))
    rendezvous = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400",
                  "--rdzv-id", "grow", "--local-addr", "127.0.0.1",
                  "--rdzv-conf", "last_call_timeout=1"]  # the first round waits 1 s, not 30, for a second node
    cmd = torchrun(model, 10**9, folder, nproc, rendezvous)  # steps: until stopped
    deadline = time.time() + timeout
    print(f"[grow {model}] first torchrun agent, {nproc} workers, run folder {folder}", flush=True)
    procs = [start(["unshare", "-n", "sh", "-c", NETNS, "sh", *cmd], folder / "torchrun-a.log")]

    def wait(done, what: str) -> None:
        while not done():
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a torchrun agent ended before {what}")
            if time.time() > deadline:
                raise TimeoutError(f"no {what} in {timeout} s")
            time.sleep(0.05)

    try:
        wait(lambda: any(r == 0 and s >= join_step for r, s, t in steps_of(folder)), f"step {join_step}")
        procs.append(start(["nsenter", "-t", str(procs[0].pid), "-n", *cmd], folder / "torchrun-b.log"))
        joined = time.time()
        print(f"[grow {model}] second agent started after step {join_step}", flush=True)
        wait(lambda: any(r >= nproc for r, s, t in steps_of(folder)), "step of the grown job")
        print(f"[grow {model}] grown job's first step {time.time() - joined:.1f} s after the join", flush=True)
        wait(lambda: len({s for r, s, t in steps_of(folder) if r >= nproc}) > steps_after, f"{steps_after} more steps")
    except BaseException:
        for log in sorted(folder.glob("torchrun-*.log")):
            print(log.read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        stop(procs, folder)

    rows, events = steps_of(folder), events_of(folder)
    grown = min(t for r, s, t in rows if r >= nproc)
    restarted = min(t for r, e, v, t in events if e == "start" and t > joined)  # the first of the grown job's workers
    before = [(r, s, t) for r, s, t in rows if t < restarted]
    after = [(r, s, t) for r, s, t in rows if t >= grown]
    resumed = min(int(v) for r, e, v, t in events if e == "loaded" and t > joined)

    def last_after(name: str) -> float:
        return max(t for r, e, v, t in events if e == name and joined < t <= grown) - joined

    def median_step(rows: list[tuple[int, int, float]]) -> float:
        ts = sorted(t for r, s, t in rows if r == 0)
        return statistics.median(b - a for a, b in zip(ts, ts[1:]))

    figures = {
        "model": model, "workers_before": nproc, "workers_after": 2 * nproc,
        "join_to_first_step": grown - joined,
        "join_to_workers_started": last_after("start"),
        "join_to_imported": last_after("imported"),
        "join_to_pg_ready": last_after("pg"),
        "join_to_built": last_after("built"),
        "join_to_loaded": last_after("loaded"),
        "last_step_before_join": max(s for r, s, t in before),
        "resumed_from": resumed,
        "steps_lost": max(s for r, s, t in before) - resumed,
        "step_s_before": median_step(before),
        "step_s_after": median_step(after),
    }
    shutil.rmtree(folder)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=list(MODELS), default="char")
    ap.add_argument("--kill-step", type=int, default=3, help="(--grow: the step after which the second agent starts)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--grow", action="store_true", help="the grow half instead: a second agent joins")
    ap.add_argument("--nproc", type=int, default=2, help="workers per agent for --grow")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=pathlib.Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.model, args.steps, args.dir)
    if args.grow:
        f = measure_grow(args.model, args.nproc, args.kill_step, timeout=args.timeout)
        print(f"torchelastic, {args.model}: a second agent joins a job of {f['workers_before']} workers (DDP, gloo, "
              f"1 thread each, DCP checkpoint after every step) after its step {args.kill_step}")
        print(f"  median step {f['step_s_before']:.3f} s on {f['workers_before']} workers, "
              f"{f['step_s_after']:.3f} s on {f['workers_after']}")
        print(f"  join -> first step of the {f['workers_after']} workers: {f['join_to_first_step']:.2f} s")
        print(f"    from the join, the last new worker: started {f['join_to_workers_started']:.2f} s, torch imported "
              f"{f['join_to_imported']:.2f} s, process group up {f['join_to_pg_ready']:.2f} s, model built "
              f"{f['join_to_built']:.2f} s, checkpoint loaded {f['join_to_loaded']:.2f} s")
        print(f"  last step of the old workers {f['last_step_before_join']}, resumed from the checkpoint of step "
              f"{f['resumed_from']}: {f['steps_lost']} completed steps lost")
        return
    f = measure_restart(args.model, args.kill_step, args.steps, args.timeout)
    print(f"torchelastic, {args.model}: {NPROC} workers (DDP, gloo, 1 thread each), DCP checkpoint after every step,"
          f" rank 1 SIGKILLed after step {args.kill_step}")
    print(f"  normal step {f['step_s']:.3f} s, of which the DCP save {f['save_s']:.3f} s")
    print(f"  kill -> first step completed by the restarted workers: {f['kill_to_first_step_any']:.2f} s on "
          f"any rank, {f['kill_to_first_step_all']:.2f} s on all")
    print(f"    from the kill, the last new worker: started {f['kill_to_workers_started']:.2f} s, torch imported "
          f"{f['kill_to_imported']:.2f} s, process group up {f['kill_to_pg_ready']:.2f} s, model built "
          f"{f['kill_to_built']:.2f} s, checkpoint loaded {f['kill_to_loaded']:.2f} s")
    print(f"  last step completed before the kill {f['last_step_before_kill']}, resumed from the checkpoint of step "
          f"{f['resumed_from']}: {f['steps_lost']} completed steps lost; step {f['resumed_from'] + 1} began again")
    print(f"  torchrun exit status {f['exit_status']}")


if __name__ == "__main__":
    main()
