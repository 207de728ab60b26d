"""Hypothesis: random valid hyperparameters, shapes and gradients against the float64 reference,
and state_dict round trips at a random step that continue bit for bit."""

from __future__ import annotations

import io

import numpy as np
import torch
from hypothesis import given, settings

from conformance.fuzzing import FuzzCase, fuzz_cases, reference_run, tolerance
from conformance.runner import max_relative_deviation
from qhoptim.torch import QHM, QHAdam, QHAdamW

EXAMPLES = 40


def _make(case: FuzzCase, params: list[torch.Tensor], foreach: bool) -> torch.optim.Optimizer:
    hp = case.hparams
    if case.family == "qhm":
        return QHM(params, hp["lr"], hp["momentum"], hp["nu"], hp["weight_decay"], foreach=foreach)
    cls = QHAdamW if case.family == "qhadamw" else QHAdam
    return cls(
        params,
        lr=hp["lr"],
        betas=(hp["beta1"], hp["beta2"]),
        nus=(hp["nu1"], hp["nu2"]),
        weight_decay=hp["weight_decay"],
        eps=hp["eps"],
        foreach=foreach,
    )


def _steps(opt: torch.optim.Optimizer, p: torch.Tensor, grads: np.ndarray) -> list[np.ndarray]:
    out = []
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
        out.append(p.detach().numpy().ravel().copy())
    return out


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=fuzz_cases())
def test_random_cases_follow_the_reference_and_resume_bit_for_bit(case: FuzzCase) -> None:
    want = reference_run(case, decoupled=case.family == "qhadamw")
    for foreach in (False, True):
        p = torch.nn.Parameter(torch.tensor(case.x0))
        opt = _make(case, [p], foreach)
        got = np.stack([case.x0.ravel(), *_steps(opt, p, case.grads)])
        assert max_relative_deviation(got, want) <= tolerance(case)

        # Interrupted at a random step: save, load into a fresh optimizer, continue.
        k = case.resume_at
        p = torch.nn.Parameter(torch.tensor(case.x0))
        opt = _make(case, [p], foreach)
        _steps(opt, p, case.grads[:k])
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        buffer.seek(0)
        q = torch.nn.Parameter(p.detach().clone())
        resumed = _make(case, [q], foreach)
        resumed.load_state_dict(torch.load(buffer, weights_only=True))
        continued = np.stack(_steps(resumed, q, case.grads[k:]))
        np.testing.assert_array_equal(continued, got[k + 1 :])
