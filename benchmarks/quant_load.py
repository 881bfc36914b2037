"""Loading GPT-2 124M quantized: `GPT2.from_pretrained(dir, quant=...)`, which converts
tensor by tensor from the safetensors file, and `dtm.quant.quantize` on a model whose weights
are still on disk (`model.load(path, mmap=True)`: DTM's own layout, mapped), against loading
the f32 model and calling `dtm.quant.quantize` on it (issue 34's goal: peak RSS at most 1.3x
the quantized model's resident size). Each load runs in a fresh process (peak: VmHWM, which a process does not
inherit); the checkpoint is random weights in Hugging Face's layout, written once.

    python benchmarks/quant_load.py [--dtypes q8_0 q4_0 bf16]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

JOB = """
import sys, time
import dtm
from dtm.models.gpt2 import GPT2, GPT2Config
t = time.perf_counter()
if sys.argv[2] == "as it loads":
    model = GPT2.from_pretrained(sys.argv[1], quant=sys.argv[3])
elif sys.argv[2] == "mapped, then quantize":
    model = GPT2(GPT2Config(), init=False)
    model.load(sys.argv[1] + "/dtm.safetensors", mmap=True)
    dtm.quant.quantize(model, sys.argv[3])
else:
    model = dtm.quant.quantize(GPT2.from_pretrained(sys.argv[1]), sys.argv[3])
took = time.perf_counter() - t
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024, took)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["q8_0", "q4_0", "bf16"])
    args = ap.parse_args()
    import dtm
    from dtm.models.gpt2 import GPT2, GPT2Config

    with tempfile.TemporaryDirectory() as d:
        dtm.manual_seed(0)
        model = GPT2(GPT2Config())
        model.save_pretrained(d)  # Hugging Face's layout, for from_pretrained
        model.save(f"{d}/dtm.safetensors")  # DTM's, for load(mmap=True)
        del model
        print("GPT-2 124M, random weights (model.safetensors, f32, 475 MiB); each load in a fresh process")
        print(f"{'dtype':>6} | {'how':>24} | {'resident after':>14} | {'peak':>9} | {'peak/resident':>13} | {'time':>6}")
        for dtype in args.dtypes:
            for how in ("as it loads", "mapped, then quantize", "f32 load, then quantize"):
                r = subprocess.run([sys.executable, "-c", JOB, d, how, dtype], capture_output=True, text=True,
                                   check=True)
                resident, peak, took = map(float, r.stdout.split())
                print(f"{dtype:>6} | {how:>24} | {resident:>10.0f} MiB | {peak:>5.0f} MiB | {peak / resident:>12.2f}x "
                      f"| {took:>5.2f}s", flush=True)


if __name__ == "__main__":
    main()
