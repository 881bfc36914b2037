"""DDP, tensor parallel and FSDP on a small GPT-2 (dtm.parallel, 4 in-process devices): one
AdamW training step under DP=2, TP=2, DP=2 x TP=2 and FSDP=4 gives the loss and the updated
weights of the same step on one device. A tensor-parallel MLP's local program has exactly one
all_reduce, a GPT-2 block's has two (attention split by heads, then the MLP) and no
all_to_all; DDP's gradient all_reduces merge into flat buckets with the same results, in an
eager backward and in a whole step under dtm.jit."""

from __future__ import annotations

import numpy as np
import pytest

import dtm
import dtm.ir as ir
from dtm.compiler.spmd import bucket_all_reduces
from dtm.compiler.spmd.bucket import SOLO_BYTES
from dtm.models.gpt2 import MLP, GPT2, Block, GPT2Config
from dtm.nn.functional import cross_entropy
from dtm.parallel import DDP, GPT2_PLAN, fsdp, tensor_parallel
from dtm.runtime.l0 import L0Executor

CONFIG = GPT2Config(vocab_size=101, n_positions=16, n_embd=32, n_layer=1, n_head=4)  # 101 rows: uneven shards
IDS = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (4, 9))


@pytest.fixture(scope="module", autouse=True)
def four_devices():
    dtm.devices(4)


def model() -> GPT2:
    dtm.manual_seed(0)
    return GPT2(CONFIG)


def train_step(net, params) -> float:
    opt = dtm.optim.AdamW(params, lr=1e-2)
    logits = net(IDS[:, :-1])
    loss = cross_entropy(logits.reshape(-1, CONFIG.vocab_size), dtm.tensor(IDS[:, 1:].reshape(-1)))
    loss.backward()
    opt.step()
    return loss.item()


@pytest.fixture(scope="module")
def reference() -> tuple[float, dict]:
    m = model()
    loss = train_step(m, list(m.parameters()))
    return loss, {k: v.numpy() for k, v in m.state_dict().items()}


def dp(m):
    return DDP(m, dtm.Mesh({"dp": 2}))


def tp(m):
    return tensor_parallel(m, dtm.Mesh({"tp": 2}), GPT2_PLAN)


def dp_tp(m):
    mesh = dtm.Mesh({"dp": 2, "tp": 2})
    return DDP(tensor_parallel(m, mesh, GPT2_PLAN), mesh)


def fsdp4(m):
    return fsdp(m, dtm.Mesh({"dp": 4}))


@pytest.mark.parametrize("wrap", [dp, tp, dp_tp, fsdp4], ids=["DP=2", "TP=2", "DP=2xTP=2", "FSDP=4"])
def test_gpt2_training_step_equals_one_device(wrap, reference):
    want_loss, want = reference
    m = model()
    params = list(m.parameters())
    net = wrap(m)
    assert all(p.device_mesh is not None for p in params)
    loss = train_step(net, params)
    assert abs(loss - want_loss) < 1e-5
    for name, p in m.state_dict().items():
        assert p.device_mesh is not None, name  # the step kept the parameters distributed
        np.testing.assert_allclose(p.numpy(), want[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_layouts_the_helpers_set():
    m = model()
    mesh = dtm.Mesh({"dp": 2, "tp": 2})
    DDP(tensor_parallel(m, mesh, GPT2_PLAN), mesh)
    S, R = dtm.Shard, dtm.Replicate
    assert m.h[0].mlp.c_fc.weight.placements == (R(), S(0))  # column parallel: output features
    assert m.h[0].mlp.c_proj.weight.placements == (R(), S(1))  # row parallel: input features
    assert m.h[0].mlp.c_proj.bias.placements == (R(), R())
    assert m.wte.weight.placements == (R(), S(0))  # vocab parallel
    assert m.ln_f.weight.placements == (R(), R())
    f = model()
    fsdp4(f)
    assert f.wte.weight.placements == (S(0),)
    assert [p.shape for p in f.wte.weight.local_shards()] == [(26, 32)] * 3 + [(23, 32)]


def test_tensor_parallel_mlp_has_one_all_reduce():
    dtm.manual_seed(1)
    mlp = MLP(CONFIG)
    x = dtm.randn(2, 5, CONFIG.n_embd)
    want = mlp(x).numpy()
    tensor_parallel(mlp, dtm.Mesh({"tp": 2}), {"c_fc": "colwise", "c_proj": "rowwise"})
    fwd = dtm.jit(lambda x: mlp(x))
    for rank in (0, 1):
        local = fwd.ir(x, view="local", rank=rank).funcs["main"]
        assert collectives(local) == ["all_reduce"]
    np.testing.assert_allclose(fwd(x).numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mlp(x).numpy(), want, rtol=1e-5, atol=1e-6)


def collectives(func) -> list[str]:
    return [op.name for op in func.ops if op.name in ir.REGISTRY and
            ir.REGISTRY[op.name].category is ir.Category.COLLECTIVE]


def test_tensor_parallel_attention_splits_by_heads():
    """Megatron's block: each rank attends over its own heads (c_attn's rows are stored head
    by head), so the forward's only collectives are c_proj's all_reduce and the MLP's."""
    dtm.manual_seed(2)
    block = Block(CONFIG)
    x = dtm.randn(2, 5, CONFIG.n_embd)
    want = block(x).numpy()
    plan = {k.removeprefix("h.*."): v for k, v in GPT2_PLAN.items() if k.startswith("h.*.")}
    tensor_parallel(block, dtm.Mesh({"tp": 2}), plan)
    fwd = dtm.jit(lambda x: block(x))
    for rank in (0, 1):
        local = fwd.ir(x, view="local", rank=rank).funcs["main"]
        assert collectives(local) == ["all_reduce", "all_reduce"]
        sdpa = [op for op in local.ops if op.name == "scaled_dot_product_attention"]
        head_dim = CONFIG.n_embd // CONFIG.n_head
        assert [op.operands[0].type.shape for op in sdpa] == [(2, CONFIG.n_head // 2, 5, head_dim)]
    np.testing.assert_allclose(fwd(x).numpy(), want, rtol=1e-5, atol=1e-6)


def test_gradient_all_reduces_merge_into_buckets():
    b = ir.Builder()
    b.mesh("m", dp=2)
    f = b.func("f")
    xs = [f.param(t, name=f"g{i}") for i, t in enumerate(["f32[3, 4]", "f32[5]", "f32[7]"])]
    red = [f.all_reduce(x, mesh="m", axes=["dp"], op="sum") for x in xs[:2]]
    used = f.neg(red[1])  # reads a member: held back until its bucket is emitted
    red.append(f.all_reduce(used, mesh="m", axes=["dp"], op="sum"))  # reads a held value: [g0, g1] first
    red.append(f.all_reduce(xs[2], mesh="m", axes=["dp"], op="sum"))
    late = f.neg(red[3])  # (as an optimizer's update of a gradient)
    f.ret(*red, used, late)
    m = b.build()
    one = bucket_all_reduces(m, "f", 1 << 20)
    ops = [op.name for op in one.funcs["f"].ops]
    assert ops.count("all_reduce") == 2  # [g0, g1], then [-g1 reduced, g2]
    assert ops.index("all_reduce") < ops.index("neg") < len(ops) - 1 - ops[::-1].index("all_reduce")
    two = bucket_all_reduces(m, "f", 64)  # 48 + 20 bytes > 64: g0 and g1 alone, then the last two (48 bytes)
    assert [op.name for op in two.funcs["f"].ops].count("all_reduce") == 3
    rng = np.random.default_rng(0)
    inputs = [[rng.standard_normal(x.type.shape).astype(np.float32) for x in xs] for _ in range(2)]
    ex = L0Executor(2, timeout=10)
    want = ex.run([m, m], "f", inputs)
    for bucketed in (one, two):
        got = ex.run([bucketed, bucketed], "f", inputs)
        for r in range(2):
            for g, w in zip(got[r], want[r]):
                np.testing.assert_array_equal(g, w)
    ex.close()


def test_a_large_all_reduce_stays_alone_and_small_ones_merge_around_it():
    """One of SOLO_BYTES or more is not copied into a bucket (its own call costs less than
    the copy); the small ones before and after it still share one."""
    n = SOLO_BYTES // 4
    b = ir.Builder()
    b.mesh("m", dp=2)
    f = b.func("f")
    xs = [f.param(t, name=f"g{i}") for i, t in enumerate(["f32[3]", f"f32[{n}]", "f32[5]", f"f32[{n - 1}]"])]
    f.ret(*[f.all_reduce(x, mesh="m", axes=["dp"], op="sum") for x in xs])
    m = b.build()
    ops = bucket_all_reduces(m, "f", 64 << 20).funcs["f"].ops
    sizes = [op.operands[0].type.shape[0] for op in ops if op.name == "all_reduce"]
    assert sizes == [n, 3 + 5 + n - 1]  # the large one as it was; the rest in one bucket, emitted at the end
    rng = np.random.default_rng(2)
    inputs = [[rng.standard_normal(x.type.shape).astype(np.float32) for x in xs] for _ in range(2)]
    ex = L0Executor(2, timeout=10)
    want, got = ex.run([m, m], "f", inputs), ex.run([bucket_all_reduces(m, "f", 64 << 20)] * 2, "f", inputs)
    ex.close()
    for r in range(2):
        for g_, w_ in zip(got[r], want[r]):
            np.testing.assert_array_equal(g_, w_)


def test_collectives_pass_an_open_bucket_and_other_effects_end_it():
    b = ir.Builder()
    b.mesh("m", dp=2)
    f = b.func("f")
    w, g0, g1, g2 = (f.param("f32[4]", name=n) for n in ("w", "g0", "g1", "g2"))
    r0 = f.all_reduce(g0, mesh="m", axes=["dp"], op="sum")
    gathered = f.all_gather(g1, mesh="m", axes=["dp"], dim=0)  # reads nothing held: r0's bucket stays open
    r1 = f.all_reduce(g1, mesh="m", axes=["dp"], op="sum")
    f.assign(w, f.neg(r1))  # an effect that is not a collective: the bucket [g0, g1] is emitted before it
    r2 = f.all_reduce(g2, mesh="m", axes=["dp"], op="sum")
    r3 = f.all_reduce(r2, mesh="m", axes=["dp"], op="sum")  # reads r2: its bucket first
    f.ret(r0, gathered, r3)
    m = b.build()
    ops = [op.name for op in bucket_all_reduces(m, "f", 1 << 20).funcs["f"].ops]
    assert [n for n in ops if n in ("all_reduce", "all_gather", "assign")] == \
        ["all_gather", "all_reduce", "assign", "all_reduce", "all_reduce"]
    rng = np.random.default_rng(1)
    inputs = [[rng.standard_normal(4).astype(np.float32) for _ in range(4)] for _ in range(2)]
    ex = L0Executor(2, timeout=10)
    want = ex.run([m, m], "f", [list(i) for i in inputs])
    bucketed = bucket_all_reduces(m, "f", 1 << 20)
    got = ex.run([bucketed, bucketed], "f", [list(i) for i in inputs])
    ex.close()
    for r in range(2):
        for g_, w_ in zip(got[r], want[r]):
            np.testing.assert_array_equal(g_, w_)


@pytest.mark.parametrize("wrap, buckets", [(dp, [("dp",)]), (dp_tp, [("dp",), ("dp", "tp")])],
                         ids=["DP=2", "DP=2xTP=2"])
def test_a_jitted_step_buckets_its_gradients_and_equals_one_device(wrap, buckets, reference):
    """Under dtm.jit the optimizer's updates read the reduced gradients in the same program
    (and the traced order reads each right after its all_reduce): the gradients' all_reduces
    still merge, one per group (the TP-sharded weights' over dp, the replicated ones' over
    dp and tp), the reads held back until the bucket is reduced, and the tensor-parallel
    collectives of the backward pass move past them."""
    want_loss, want = reference
    m = model()
    params = list(m.parameters())
    net = wrap(m)
    opt = dtm.optim.AdamW(params, lr=1e-2)

    @dtm.jit
    def step(x, y):
        loss = cross_entropy(net(x).reshape(-1, CONFIG.vocab_size), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x, y = dtm.tensor(IDS[:, :-1]), dtm.tensor(IDS[:, 1:].reshape(-1))
    assert abs(step(x, y).item() - want_loss) < 1e-5
    for name, p in m.state_dict().items():
        np.testing.assert_allclose(p.numpy(), want[name], rtol=1e-4, atol=1e-4, err_msg=name)
    for rank in range(params[0].device_mesh.size):
        local = step.ir(x, y, view="local", rank=rank).funcs["main"]
        grads = [tuple(op.attrs["axes"]) for op in local.ops if op.name == "all_reduce" and "dp" in op.attrs["axes"]]
        assert grads == buckets, rank


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_batch_of_fewer_rows_than_ranks_trains_as_on_one_device(jitted):
    """One row over DP=2: one device's shard of the batch is empty (its products have no
    rows: the process was killed by SIGFPE), and the step is the one-device step."""
    def one_step(wrap):
        m = model()
        net = wrap(m)
        opt = dtm.optim.AdamW(list(m.parameters()), lr=1e-2)

        def step(x, y):
            loss = cross_entropy(net(x).reshape(-1, CONFIG.vocab_size), y)
            loss.backward()
            opt.step()
            return loss

        run = dtm.jit(step) if jitted else step
        loss = run(dtm.tensor(IDS[:1, :-1]), dtm.tensor(IDS[:1, 1:].reshape(-1))).item()
        return loss, {k: v.numpy() for k, v in m.state_dict().items()}

    want_loss, want = one_step(lambda m: m)
    loss, got = one_step(dp)
    assert abs(loss - want_loss) < 1e-5
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name)
