"""A run given up while it runs (dtm/runtime/abandon.py; live resize: a collective of an
elastic step lost a peer): the cpu executor stops after the step that was not a compiled
kernel, runs none of the kernels after it, and returns stand-ins of the results' types
(NaN, zeros for integers); once resumed, the same plan computes what numpy does again."""

from __future__ import annotations

import numpy as np
import pytest

from dtm.ir import parse
from dtm.runtime import abandon
from dtm.runtime import cpu as cpu_mod
from dtm.runtime.backend import get_backend

# a kernel, a host step (argsort has no kernel in any backend), then a kernel that reads both
SOURCE = """dtm 1.1

func @main(%x: f32[4, 8]) -> (f32[4, 8], i64[4, 8], f32[4, 8]) {
  %a = mul %x, %x : f32[4, 8]
  %i = argsort %a {axis = 1, descending = false} : i64[4, 8]
  %f = cast %i {to = f32} : f32[4, 8]
  %c = add %a, %f : f32[4, 8]
  return %a, %i, %c
}
"""


@pytest.fixture
def plan():
    yield get_backend("cpu").plan(parse(SOURCE), "main")
    abandon.resume()


def want(x):
    a = x * x
    i = np.argsort(a, axis=1, kind="stable")
    return a, i, a + i.astype(np.float32)


def test_an_abandoned_run_skips_the_rest_and_gives_stand_ins(plan, monkeypatch):
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    launched, other = [], cpu_mod.Plan._other

    def host_step_that_loses_a_peer(self, *args):
        ctx = other(self, *args)
        abandon.abandon()  # as ProcessGroup._poisonable does when a collective lost a peer
        return ctx

    assert any(type(w) is not int for w, _ in plan.schedule) and type(plan.schedule[-1][0]) is int
    monkeypatch.setattr(cpu_mod.Plan, "_other", host_step_that_loses_a_peer)
    launch = plan._launch  # (the runtime's C launch loop: one call per run of compiled steps)
    monkeypatch.setattr(plan, "_launch", lambda *a: (launched.append(a), launch(*a))[1])
    a, i, c = plan.run([x])
    first_host_step = next(k for k, (w, _) in enumerate(plan.schedule) if type(w) is not int)
    assert len(launched) == first_host_step  # the runs before it, none after
    assert (a.shape, a.dtype, i.shape, i.dtype, c.shape, c.dtype) == ((4, 8), np.float32, (4, 8), np.int64,
                                                                      (4, 8), np.float32)
    assert np.isnan(a).all() and np.isnan(c).all() and (i == 0).all()


def test_a_resumed_plan_runs_whole_again(plan):
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    abandon.abandon()
    assert np.isnan(plan.run([x])[0]).all()
    abandon.resume()
    for got, expected in zip(plan.run([x]), want(x)):
        np.testing.assert_array_equal(got, expected)


def test_setting_poison_off_resumes(plan):
    from dtm.runtime.process_group import ProcessGroup

    pg = ProcessGroup.__new__(ProcessGroup)  # (no mesh: only the flag's property is used)
    pg.poison = True
    abandon.abandon()
    pg.poison = False  # dtm.elastic, when a step's body ends
    assert not abandon.abandoned()
