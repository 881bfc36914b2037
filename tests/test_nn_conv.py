"""Issue 30: conv1d / conv2d and nn.Conv1d / nn.Conv2d against torch 2.13. The convolution
is composed of front-end ops (pad, strided slices, a matrix product), so autodiff and the
`cpu` compiler take it as they take any other program: values and gradients on both
backends, the modules' padding modes and torch's state_dicts, a small CNN trained under
dtm.jit, and a plan with no reference fallback steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import dtm
import dtm.nn.functional as F
from dtm.backends.cpu.passes import compile_func
from dtm.errors import DTMError
from dtm.runtime.backend import BACKENDS

# torch warns that its own 'same' padding of an even kernel copies the input
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")
TOL = dict(rtol=1e-4, atol=1e-5)  # f32 sums of up to ~50 products, in another order than torch's


@pytest.fixture(params=["ref"] + (["cpu"] if "cpu" in BACKENDS else []))
def backend(request, monkeypatch):
    monkeypatch.setenv("DTM_BACKEND", request.param)
    return request.param


def arrays(*shapes, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def close(got, want, what: str = "") -> None:
    got = got.numpy() if isinstance(got, dtm.Tensor) else np.asarray(got)
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    np.testing.assert_allclose(got, want, err_msg=what, **TOL)


# (input shape, weight shape, keyword arguments); the unbatched cases have a rank less. Each
# case on the cpu backend compiles two programs (a second or two on a cold cache), so the
# cases are few and each varies several arguments; the CNN below covers the defaults.
CONV1D = {
    "stride-pad-groups-nobias": ((2, 4, 11), (4, 2, 3), dict(stride=2, padding=1, groups=2, bias=False)),
    "dilation-same": ((1, 3, 10), (5, 3, 2), dict(dilation=3, padding="same")),
    "valid-stride-tuples": ((2, 3, 8), (2, 3, 4), dict(padding="valid", stride=(3,), dilation=(1,))),
    "unbatched": ((3, 7), (4, 3, 3), dict(padding=2)),
}
CONV2D = {
    "stride-pad-groups": ((2, 4, 8, 7), (6, 2, 3, 2), dict(stride=(2, 1), padding=(1, 2), groups=2)),
    "dilation-same-nobias": ((1, 2, 9, 8), (3, 2, 3, 2), dict(dilation=(2, 1), padding="same", bias=False)),
    "depthwise": ((2, 6, 6, 5), (6, 1, 3, 3), dict(groups=6, stride=2, padding=1)),
    "unbatched-dilated": ((3, 6, 5), (2, 3, 2, 2), dict(dilation=2, stride=(1, 2))),
    "1x1": ((2, 5, 4, 3), (3, 5, 1, 1), dict(stride=2)),
}


def _run_case(fname: str, case: tuple) -> None:
    x_shape, w_shape, kwargs = case
    kwargs = dict(kwargs)
    with_bias = kwargs.pop("bias", True)
    x, w, b = arrays(x_shape, w_shape, (w_shape[0],))
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    dx, dw, db = (dtm.tensor(a, requires_grad=True) for a in (x, w, b))
    tout = getattr(torch.nn.functional, fname)(tx, tw, tb if with_bias else None, **kwargs)
    dout = getattr(F, fname)(dx, dw, db if with_bias else None, **kwargs)
    close(dout, tout, "output")
    (ct,) = arrays(tuple(tout.shape), seed=1)  # a loss that weighs every output differently
    (tout * torch.tensor(ct)).sum().backward()
    (dout * dtm.tensor(ct)).sum().backward()
    close(dx.grad, tx.grad, "input grad")
    close(dw.grad, tw.grad, "weight grad")
    if with_bias:
        close(db.grad, tb.grad, "bias grad")


@pytest.mark.parametrize("name", sorted(CONV1D))
def test_conv1d_values_and_gradients_match_torch(backend, name):
    _run_case("conv1d", CONV1D[name])


@pytest.mark.parametrize("name", sorted(CONV2D))
def test_conv2d_values_and_gradients_match_torch(backend, name):
    _run_case("conv2d", CONV2D[name])


def test_conv_in_f64_matches_torch_closely():
    x, w = (a.astype(np.float64) for a in arrays((2, 2, 6, 5), (3, 2, 2, 3)))
    got = F.conv2d(dtm.tensor(x), dtm.tensor(w), stride=(1, 2), padding=1).numpy()
    want = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), stride=(1, 2), padding=1).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# --- modules ------------------------------------------------------------------------------

MODULES = {
    "conv1d-reflect": (lambda nn: nn.Conv1d(3, 2, 3, padding=2, padding_mode="reflect"), (2, 3, 7)),
    "conv1d-circular-same": (lambda nn: nn.Conv1d(2, 2, 4, padding="same", padding_mode="circular"), (1, 2, 6)),
    "conv2d": (lambda nn: nn.Conv2d(4, 6, (3, 2), padding=(1, 0), groups=2, bias=False), (2, 4, 6, 5)),
    "conv2d-replicate": (lambda nn: nn.Conv2d(3, 4, 3, stride=2, padding=(2, 1), padding_mode="replicate"), (1, 3, 7, 6)),
    "conv2d-reflect-dilated": (lambda nn: nn.Conv2d(2, 3, 2, dilation=2, padding=1, padding_mode="reflect"),
                               (2, 2, 5, 5)),
    "conv2d-circular": (lambda nn: nn.Conv2d(2, 2, 3, padding=(1, 2), padding_mode="circular"), (2, 2, 4, 5)),
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_load_torch_state_and_match_its_values_and_gradients(backend, name):
    make, x_shape = MODULES[name]
    torch.manual_seed(0)
    t, d = make(torch.nn), make(dtm.nn)
    assert list(d.state_dict()) == list(t.state_dict())
    assert {k: tuple(v.shape) for k, v in d.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in t.state_dict().items()}
    d.load_state_dict(t.state_dict())
    (x,) = arrays(x_shape)
    tx, dx = torch.tensor(x, requires_grad=True), dtm.tensor(x, requires_grad=True)
    tout, dout = t(tx), d(dx)
    close(dout, tout, "output")
    (ct,) = arrays(tuple(tout.shape), seed=1)
    (tout * torch.tensor(ct)).sum().backward()
    (dout * dtm.tensor(ct)).sum().backward()
    close(dx.grad, tx.grad, "input grad")
    for (pname, tp), (dname, dp) in zip(t.named_parameters(), d.named_parameters()):
        assert pname == dname
        close(dp.grad, tp.grad, f"{pname} grad")


def test_modules_are_initialised_as_torch_does():
    """kaiming_uniform(a=sqrt(5)) for the weight and U(-1/sqrt(fan_in), ..) for the bias:
    both bounded by 1/sqrt(fan_in), fan_in = in_channels / groups * kernel size. The draws
    are DTM's, so only the bounds and the spread are compared."""
    dtm.manual_seed(0)
    m = dtm.nn.Conv2d(8, 16, (3, 5), groups=2)
    assert m.weight.shape == (16, 4, 3, 5) and m.bias.shape == (16,)
    bound = 1 / math.sqrt(4 * 3 * 5)
    for p in (m.weight, m.bias):
        v = p.numpy()
        assert np.abs(v).max() <= bound and np.abs(v).max() > 0.8 * bound, (np.abs(v).max(), bound)
    assert m.weight.numpy().std() == pytest.approx(bound / math.sqrt(3), rel=0.1)
    assert dtm.nn.Conv1d(3, 4, 2, bias=False).bias is None
    assert repr(dtm.nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)) == \
        repr(torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2))


# --- errors -------------------------------------------------------------------------------

def _both_refuse(call, match: str) -> None:
    """torch raises (RuntimeError or ValueError); DTM raises a DTMError with a like message."""
    with pytest.raises((RuntimeError, ValueError)):
        call(torch)
    with pytest.raises(DTMError, match=match):
        call(dtm)


def _conv(fn: str, x_shape, w_shape, **kwargs):
    def call(M):
        x, w = arrays(x_shape, w_shape)
        nnf = torch.nn.functional if M is torch else F
        return getattr(nnf, fn)(M.tensor(x), M.tensor(w), **kwargs)
    return call


@pytest.mark.parametrize("call,match", [
    (_conv("conv1d", (2, 3, 4, 5), (2, 3, 2)), "Expected 2D \\(unbatched\\) or 3D \\(batched\\) input to conv1d"),
    (_conv("conv2d", (3, 5), (2, 3, 2, 2)), "Expected 3D \\(unbatched\\) or 4D \\(batched\\) input to conv2d"),
    (_conv("conv2d", (1, 3, 5, 5), (2, 3, 2)), "weight"),
    (_conv("conv1d", (2, 5, 8), (4, 3, 3)), "expected input.* to have 3 channels, but got 5 channels"),
    (_conv("conv1d", (2, 4, 8), (3, 2, 3), groups=2), "expected weight to be divisible by 2"),
    (_conv("conv2d", (1, 2, 2, 5), (1, 2, 3, 3)), "Kernel size can't be greater than actual input size"),
    (_conv("conv1d", (1, 2, 5), (1, 2, 3), dilation=3), "Kernel size can't be greater than actual input size"),
    (_conv("conv1d", (1, 2, 8), (1, 2, 3), padding="same", stride=2), "padding='same' is not supported for strided"),
    (_conv("conv1d", (1, 2, 8), (1, 2, 3), padding="full"), "Invalid padding string: 'full'"),
    (_conv("conv1d", (1, 2, 8), (1, 2, 3), padding=-1), "negative padding is not supported"),
    (_conv("conv1d", (1, 2, 8), (1, 2, 3), stride=0), "non-positive stride is not supported"),
    (_conv("conv2d", (1, 2, 8, 8), (1, 2, 3, 3), stride=(1, 2, 3)), "stride"),
    (_conv("conv1d", (1, 2, 8), (1, 2, 3), groups=0), "non-positive groups is not supported"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_raise_dtm_errors_like_torchs(call, match):
    _both_refuse(call, match)


@pytest.mark.parametrize("kwargs,match", [
    (dict(in_channels=3, out_channels=4, kernel_size=3, groups=2), "in_channels must be divisible by groups"),
    (dict(in_channels=4, out_channels=3, kernel_size=3, groups=2), "out_channels must be divisible by groups"),
    (dict(in_channels=2, out_channels=2, kernel_size=3, padding_mode="mirror"), "padding_mode must be one of"),
    (dict(in_channels=2, out_channels=2, kernel_size=3, padding="same", stride=2), "padding='same' is not supported"),
])
def test_module_arguments_are_checked_as_torch_does(kwargs, match):
    _both_refuse(lambda M: M.nn.Conv2d(**kwargs), match)


def test_reflect_padding_larger_than_the_input_is_refused():
    _both_refuse(lambda M: M.nn.Conv1d(1, 1, 3, padding=4, padding_mode="reflect")(M.tensor(arrays((1, 1, 4))[0])),
                 "reflect")


# --- a small CNN under dtm.jit, and the compiled plan -------------------------------------

def _cnn(nn):
    """Conv, ReLU, conv, ReLU, global average pool (a mean), Linear."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(1, 4, 3, padding=1)
            self.c2 = nn.Conv2d(4, 6, 3, stride=2, groups=2)
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            h = self.c2(self.c1(x).relu()).relu()
            return self.fc(h.mean((2, 3)))
    return Net()


def test_a_small_cnn_trains_under_jit_as_torch(backend):
    torch.manual_seed(0)
    t, d = _cnn(torch.nn), _cnn(dtm.nn)
    d.load_state_dict(t.state_dict())
    topt, dopt = torch.optim.SGD(t.parameters(), lr=0.5), dtm.optim.SGD(d.parameters(), lr=0.5)

    @dtm.jit
    def step(x, y):
        loss = F.cross_entropy(d(x), y)
        loss.backward()
        dopt.step()
        dopt.zero_grad()
        return loss

    rng = np.random.default_rng(5)
    for i in range(3):
        x, y = rng.standard_normal((4, 1, 8, 8)).astype(np.float32), rng.integers(0, 3, 4)
        tloss = torch.nn.functional.cross_entropy(t(torch.tensor(x)), torch.tensor(y))
        tloss.backward()
        topt.step()
        topt.zero_grad()
        got = step(dtm.tensor(x), dtm.tensor(y)).item()
        assert got == pytest.approx(tloss.item(), rel=1e-5), i
    assert len(step.cache) == 1
    for k, want in t.state_dict().items():
        close(d.state_dict()[k], want, k)


def test_conv_forward_and_backward_compile_with_no_fallback_steps():
    """The plan of a conv's values and all three gradients is kernels (and row moves), no
    step that runs the reference: the convolution is compiled, not interpreted."""
    x, w, b, ct = arrays((2, 4, 7, 6), (6, 2, 3, 3), (6,), (2, 6, 4, 4))
    x, w, b = (dtm.tensor(a, requires_grad=True) for a in (x, w, b))  # captured leaves

    def grads(ct):
        out = F.conv2d(x, w, b, stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
        (out * ct).sum().backward()
        return out, x.grad, w.grad, b.grad

    program = compile_func(dtm.jit(grads).ir(dtm.tensor(ct)), "main")
    assert not program.fallbacks, str(program)
    assert program.kernels
    one_d = compile_func(dtm.jit(lambda x, w: F.conv1d(x, w, padding="same", dilation=2)).ir(
        dtm.tensor(arrays((2, 3, 9))[0]), dtm.tensor(arrays((4, 3, 3))[0])), "main")
    assert not one_d.fallbacks, str(one_d)
