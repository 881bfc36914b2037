"""`make demo`: DTM end to end, in one pipeline (L0 -> store and ingest -> checkpoint -> live
resize), on this machine:

1. ingest a real corpus (~3 MB of Python's own library) into a tensor store with two
   worker processes, their CPU and memory shown live;
2. train a byte-level GPT with DP=2 x TP=2 over 4 processes from the store's batches
   (`dtm launch --elastic 2:8`, examples/demo_train.py), saving async checkpoints and an
   in-memory snapshot every step;
3. kill one rank (SIGKILL): the job shrinks to DP=1 x TP=2 and goes on; start two ranks
   (`dtm launch --join`): it grows back to DP=2 x TP=2;
4. train the same steps on one process and check that every step's loss is the same
   across both resizes;
5. load the final checkpoint on one process and sample text, printing the loss beside the
   corpus's unigram entropy.

    python examples/demo.py [--steps 150] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import dtm  # noqa: E402
from demo_corpus import ingest_corpus, model_config, sample_from_checkpoint, unigram_entropy  # noqa: E402

DTM = str(pathlib.Path(sys.executable).parent / "dtm")
TRAIN = str(HERE / "demo_train.py")
# The distributed losses against the single-process ones. A mesh sums in another order, and at
# this model's size and learning rate those rounding differences grow over the steps (0.2% by
# step 15 here, before any resize); tests/test_elastic.py checks every step across a shrink and
# a grow at 2e-4 on the smaller char model.
RTOL = 5e-2
MARGIN = 0.4  # nats/byte the final loss must be under the unigram entropy: it learned context


def say(text: str) -> None:
    print(text, flush=True)


def launch(args: list[str], on_line) -> subprocess.Popen:
    """`dtm launch ARGS`, its lines printed (and given to `on_line`) as they come."""
    p = subprocess.Popen([DTM, "launch", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read() -> None:
        for line in p.stdout:
            if "lost during" not in line and "the coordinator lost" not in line[20:]:
                print("   ", line.rstrip(), flush=True)
            on_line(line)

    threading.Thread(target=read, daemon=True).start()
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--kill-at", type=int, default=40)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="dtm-demo-"))
    store, ckpt = work / "store", work / "ckpt"
    t0 = time.perf_counter()

    say(f"== 1. ingest Python's standard library into the store at {store} (2 worker processes)")
    st = dtm.store.open(store)
    m = ingest_corpus(st, "corpus", workers=2)
    entropy = unigram_entropy(st, "corpus")
    say(f"   {len(m.shards)} files ingested; unigram entropy {entropy:.3f} nats/byte ({time.perf_counter() - t0:.0f} s)")

    say(f"== 2-3. train DP=2 x TP=2 over 4 processes for {args.steps} steps; rank 3 dies at step {args.kill_at}, "
        "two ranks join after the shrink")
    out = work / "losses.json"
    address: list[str] = []
    joiners: list[subprocess.Popen] = []

    def on_line(line: str) -> None:
        if line.startswith("[rank 0] coordinator "):
            address.append(line.split()[-1])
        if "mesh resized to epoch 2" in line and not joiners:
            say("   -> starting two ranks with `dtm launch --join`")
            joiners.append(launch(["--join", address[0], "-n", "2", TRAIN, "--store", str(store), "--ckpt",
                                   str(ckpt), "--steps", str(args.steps)], lambda _line: None))

    t1 = time.perf_counter()
    job = launch(["-n", "4", "--axes", "dp=2,tp=2", "--elastic", "2:8", TRAIN, "--store", str(store), "--ckpt",
                  str(ckpt), "--steps", str(args.steps), "--kill", f"3:{args.kill_at}", "--out", str(out)], on_line)
    code = job.wait(timeout=600)
    for j in joiners:
        code = code or j.wait(timeout=60)
    took = time.perf_counter() - t1
    if code != 0 or not out.exists():
        say(f"FAILED: the elastic training ended with status {code}")
        return 1
    got = json.loads(out.read_text())
    say(f"   trained in {took:.0f} s through {len(got['resizes'])} resize(s)")

    say("== 4. the same steps on one process (the check that distribution and resizes change nothing)")
    want_file = work / "want.json"
    subprocess.run([sys.executable, TRAIN, "--store", str(store), "--steps", str(args.steps), "--out",
                    str(want_file)], check=True, capture_output=True, timeout=600)
    want = json.loads(want_file.read_text())["losses"]
    diff = max(abs(got["losses"][k] - want[k]) / abs(want[k]) for k in want)
    say(f"   largest relative difference over {len(want)} steps: {diff:.1e} (tolerance {RTOL:g})")
    if not diff <= RTOL:
        say("MISMATCH: the elastic run's losses differ from the single-process run")
        return 1

    say(f"== 5. load the final checkpoint ({ckpt}) on one process and sample")
    final = got["losses"][str(args.steps - 1)]
    for prompt in ("def ", "import ", "class "):
        text = sample_from_checkpoint(ckpt, model_config(), prompt, 120)
        say("   " + repr(text))
    say(f"== done in {time.perf_counter() - t0:.0f} s: final loss {final:.3f} nats/byte against the corpus's unigram "
        f"entropy {entropy:.3f}; resizes: " + "; ".join(got["resizes"]))
    return 0 if final < entropy - MARGIN else 1


if __name__ == "__main__":
    sys.exit(main())
