# requires: torch, qhoptim.torch
"""Moving torch.optim settings to QHM / QHAdam: same trajectory, then the paper's start.

Each pair trains the same float64 model from the same initialization and
compares the final parameters: the conversions of ``qhoptim.convert`` are exact.
"""

import torch

from qhoptim import convert
from qhoptim.torch import QHM, QHAdam, QHAdamW

torch.manual_seed(0)
X = torch.randn(128, 6, dtype=torch.float64)
Y = torch.sin(X @ torch.randn(6, 1, dtype=torch.float64))


def train(make_optimizer, steps=50):
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    ).double()
    optimizer = make_optimizer(model.parameters())
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(X), Y).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def compare(name, theirs, ours):
    a, b = train(theirs), train(ours)
    diff = ((a - b).abs().max() / a.abs().max()).item()
    print(f"{name:44s} max rel. difference {diff:.1e}")
    assert diff < 1e-12, diff


# SGD with Nesterov momentum: torch's buffer is unnormalized, QHM's is an
# average, so the learning rate is divided by (1 - momentum).
p = convert.from_nesterov(lr=0.1, momentum=0.9)
print(p)  # lr = 1.0 (up to rounding), nu = momentum = 0.9
compare(
    "SGD(lr=0.1, momentum=0.9, nesterov=True)",
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: QHM(ps, **p.as_kwargs()),
)
# Plain momentum: nu = 1. QHM.from_momentum returns the same keyword arguments.
compare(
    "SGD(lr=0.05, momentum=0.95, weight_decay=1e-3)",
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.95, weight_decay=1e-3),
    lambda ps: QHM(ps, weight_decay=1e-3, **QHM.from_momentum(lr=0.05, momentum=0.95)),
)
# Adam is QHAdam with nus = (1, 1); AdamW is QHAdamW.
q = convert.from_adam(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
compare(
    "Adam(lr=1e-2)",
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
    lambda ps: QHAdam(ps, **q.as_kwargs()),
)
compare(
    "AdamW(lr=1e-2, weight_decay=1e-2)",
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2),
    lambda ps: QHAdamW(ps, weight_decay=1e-2, **q.as_kwargs()),
)

# The paper's starting point (Sec. 7.1): keep the converted learning rate,
# set nu = 0.7 and beta = 0.999; for Adam, nu1 = 0.7, beta1 = 0.999 and
# nu2, beta2, lr, eps unchanged.
params = torch.nn.Linear(2, 1).parameters()
qhm = QHM(params, lr=p.lr, momentum=0.999, nu=0.7)
params = torch.nn.Linear(2, 1).parameters()
qhadam = QHAdam(params, lr=1e-2, betas=(0.999, 0.999), nus=(0.7, 1.0))
print("QHM start:", {k: qhm.defaults[k] for k in ("lr", "momentum", "nu")})
print("QHAdam start:", {k: qhadam.defaults[k] for k in ("lr", "betas", "nus")})
