# requires: torch, qhoptim.torch
"""Code written for qhoptim 1.1.0 (``qhoptim.pyt``) runs unchanged on qhoptim 2.

What to check when upgrading:

* ``from qhoptim.pyt import QHM, QHAdam, QHAdamW`` still works (the classes are
  those of ``qhoptim.torch``, with the same positional arguments);
* the ``from_*`` conversions still return constructor keyword arguments;
* ``QHAdamW`` is a class now and, like ``torch.optim.AdamW``, defaults to
  ``weight_decay=1e-2`` -- 1.1.0's function defaulted to 0, so pass it explicitly.
"""

import torch

import qhoptim.pyt
import qhoptim.torch
from qhoptim.pyt import QHM, QHAdam, QHAdamW

assert qhoptim.pyt.QHM is qhoptim.torch.QHM
model = torch.nn.Linear(4, 2)

# 1.1.0 style, unchanged: explicit lr, momentum, nu (they now have defaults too).
opt = QHM(model.parameters(), lr=1.0, momentum=0.999, nu=0.7)
# 1.1.0's conversions, as keyword arguments.
opt = QHM(model.parameters(), **QHM.from_pid(k_p=-0.1, k_i=1.0, k_d=3.0))
nadam = QHAdam.from_nadam(lr=1e-3, betas=(0.9, 0.999))
print("from_nadam:", nadam)
opt = QHAdam(model.parameters(), weight_decay=1e-4, **nadam)

# QHAdamW: state the weight decay you want (1.1.0 defaulted to 0).
default = QHAdamW(model.parameters()).defaults["weight_decay"]
print("QHAdamW's default weight_decay is now", default)
kwargs = {"lr": 1e-3, "nus": (0.7, 1.0), "betas": (0.995, 0.999), "weight_decay": 0.0}
opt = QHAdamW(model.parameters(), **kwargs)

# Checkpoints: state_dict / load_state_dict as for any torch optimizer (a 1.1.0
# QHAdam state is converted on load, see docs/torch.md).
model(torch.randn(8, 4)).square().mean().backward()
opt.step()
restored = QHAdamW(model.parameters(), **kwargs)
restored.load_state_dict(opt.state_dict())
print("state keys:", sorted(restored.state[model.weight]))
