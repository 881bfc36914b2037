"""Random programs on the cpu backend agree with the reference: chains of elementwise ops,
broadcasts, movement ops (reshape, permute, slice, pad, concat, flip), reductions and matrix
products, with random shapes, so fusion and index arithmetic meet combinations no
hand-written test lists. Seeded: a failure names its seed and prints its program."""

from __future__ import annotations

import numpy as np
import pytest

from dtm.ir import Builder, format
from dtm.ref import run as ref_run
from dtm.runtime.backend import get_backend

CPU = get_backend("cpu")
UNARY = ["tanh", "sigmoid", "neg", "abs", "sin", "floor"]
BINARY = ["add", "sub", "mul", "max", "min"]


def _factor(n: int, rng) -> list[int]:
    """A random factorisation of n into 1 to 3 dims."""
    dims = []
    for _ in range(rng.integers(0, 3)):
        divs = [d for d in range(2, n + 1) if n % d == 0]
        if not divs:
            break
        d = int(rng.choice(divs))
        dims.append(d)
        n //= d
    dims.append(n)
    rng.shuffle(dims)
    return dims


def program(seed: int):
    rng = np.random.default_rng(seed)
    b = Builder()
    f = b.func("f")
    vals = []
    inputs = []
    for _ in range(rng.integers(1, 4)):
        shape = [int(s) for s in rng.integers(1, 6, size=rng.integers(1, 4))]
        vals.append(f.param(f"f32[{', '.join(map(str, shape))}]"))
        inputs.append(rng.standard_normal(shape).astype(np.float32))

    def shape(v):
        return list(v.type.shape)

    for _ in range(rng.integers(4, 14)):
        x = vals[rng.integers(len(vals))]
        kind = rng.choice(["unary", "binary", "binary", "reduce", "permute", "reshape", "slice", "pad", "concat",
                           "flip", "broadcast", "matmul", "softmax", "where", "argmax", "cast", "norm", "iota"])
        s = shape(x)
        try:
            if kind == "unary":
                v = f.op(str(rng.choice(UNARY)), x)
            elif kind == "binary":
                others = [y for y in vals if len(shape(y)) <= len(s) and all(
                    a == b or a == 1 for a, b in zip(shape(y)[::-1], s[::-1]))]
                y = others[rng.integers(len(others))]
                v = f.op(str(rng.choice(BINARY)), x, y) if rng.random() < 0.5 else f.op(str(rng.choice(BINARY)), y, x)
            elif kind == "reduce":
                axes = sorted(set(int(a) for a in rng.integers(0, len(s), size=rng.integers(1, len(s) + 1))))
                v = f.op(str(rng.choice(["reduce_sum", "reduce_max", "reduce_min"])), x, axes=axes,
                         keepdims=bool(rng.random() < 0.5))
            elif kind == "permute":
                v = f.op("permute", x, perm=[int(p) for p in rng.permutation(len(s))])
            elif kind == "reshape":
                v = f.op("reshape", x, shape=_factor(int(np.prod(s)), rng))
            elif kind == "slice":
                start = [int(rng.integers(0, d)) for d in s]
                stop = [int(rng.integers(a + 1, d + 1)) for a, d in zip(start, s)]
                v = f.op("slice", x, start=start, stop=stop, step=[int(rng.integers(1, 3)) for _ in s])
            elif kind == "pad":
                v = f.op("pad", x, low=[int(rng.integers(0, 2)) for _ in s], high=[int(rng.integers(0, 2)) for _ in s],
                         value=float(rng.standard_normal()))
            elif kind == "concat":
                axis = int(rng.integers(len(s)))
                same = [y for y in vals if len(shape(y)) == len(s) and all(
                    a == b for i, (a, b) in enumerate(zip(shape(y), s)) if i != axis)]
                v = f.op("concat", x, same[rng.integers(len(same))], axis=axis)
            elif kind == "flip":
                v = f.op("flip", x, axes=sorted(set(int(a) for a in rng.integers(0, len(s), size=2))))
            elif kind == "broadcast":
                v = f.op("broadcast_to", x, shape=[int(rng.integers(1, 4))] + [d if d != 1 else int(rng.integers(1, 4))
                                                                              for d in s])
            elif kind == "matmul":
                if len(s) < 2:
                    continue
                ys = [y for y in vals if len(shape(y)) >= 2 and shape(y)[-2] == s[-1]]
                if not ys:
                    w = f.param(f"f32[{s[-1]}, {int(rng.integers(1, 7))}]")
                    inputs.append(rng.standard_normal(w.type.shape).astype(np.float32))
                    ys = [w]
                v = f.op("matmul", x, ys[rng.integers(len(ys))])
            elif kind == "where":
                c = f.op("gt", x, f.op("full", type="f32[]", value=float(rng.standard_normal())))
                y = vals[rng.integers(len(vals))]
                v = f.op("where", c, x, y) if rng.random() < 0.5 else f.op("where", c, y, x)
            elif kind == "argmax":
                i = f.op(str(rng.choice(["argmax", "argmin"])), x, axis=int(rng.integers(len(s))), keepdims=True)
                v = f.op("cast", f.op("mul", i, i), to="f32")
            elif kind == "cast":
                t = str(rng.choice(["i32", "f64", "i8", "u16"]))
                v = f.op("cast", f.op("abs", f.op("cast", f.op("mul", x, f.op("full", type="f32[]", value=7.0)), to=t)),
                         to="f32")
            elif kind == "norm":
                v = f.op("layer_norm", x) if rng.random() < 0.5 else \
                    f.op("gelu", x, approximate=str(rng.choice(["none", "tanh"])))
            elif kind == "iota":
                i = f.op("iota", type=f"i64[{', '.join(map(str, s))}]", dim=int(rng.integers(len(s))))
                v = f.op("add", x, f.op("cast", i, to="f32"))
            else:
                v = f.op(str(rng.choice(["softmax", "log_softmax"])), x, axis=int(rng.integers(len(s))))
        except Exception:  # a random op that does not type-check: try another
            continue
        vals.append(v)
    n_params = len(f.func.params)
    outs = [vals[-1]] + [vals[int(i)] for i in rng.integers(n_params, len(vals), size=2) if int(i) < len(vals)]
    f.ret(*dict.fromkeys(outs))
    return b.build(), inputs


@pytest.mark.parametrize("seed", range(30))
def test_random_program(seed):
    m, inputs = program(seed)
    want = ref_run(m, "f", [x.copy() for x in inputs])
    got = CPU.run(m, "f", [x.copy() for x in inputs])
    for w, g in zip(want, got):
        assert g.shape == w.shape, format(m)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, equal_nan=True, err_msg=format(m))
