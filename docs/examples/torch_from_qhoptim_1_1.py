# requires: torch, qhoptim.torch
"""Code written for qhoptim 1.1.0 runs unchanged on qhoptim 2; new code uses ``qhoptim.torch``.

What to check when upgrading (the full list is in CHANGELOG.md):

* ``from qhoptim.pyt import QHM, QHAdam, QHAdamW`` still works: subclasses of
  ``qhoptim.torch``'s classes with 1.1.0's positional arguments, names and
  defaults -- ``QHAdamW`` defaults to ``weight_decay=0`` there;
* ``qhoptim.torch.QHAdamW`` defaults to ``weight_decay=1e-2``, like
  ``torch.optim.AdamW``;
* decoupled weight decay is spelled ``decoupled_weight_decay`` in
  ``qhoptim.torch``; 1.1.0's ``weight_decay_type="direct"`` (QHM) and
  ``decouple_weight_decay`` (QHAdam) still work there, with a ``DeprecationWarning``;
* the ``from_*`` classmethods still return constructor keyword arguments, and
  ``from_params`` builds an optimizer from a ``qhoptim.convert`` result.
"""

import warnings

import torch

import qhoptim.pyt
import qhoptim.torch
from qhoptim import convert

model = torch.nn.Linear(4, 2)
assert issubclass(qhoptim.pyt.QHM, qhoptim.torch.QHM)

# 1.1.0 code, unchanged, through qhoptim.pyt: no warning.
with warnings.catch_warnings():
    warnings.simplefilter("error")
    old = qhoptim.pyt.QHM(model.parameters(), 1.0, 0.999, 0.7, 1e-4, "direct")
    nadam = qhoptim.pyt.QHAdam.from_nadam(lr=1e-3, betas=(0.9, 0.999))
    print("from_nadam:", nadam)
    opt = qhoptim.pyt.QHAdam(
        model.parameters(), weight_decay=1e-4, decouple_weight_decay=True, **nadam
    )

# The same QHM in qhoptim.torch's spelling.
new = qhoptim.torch.QHM(
    model.parameters(), lr=1.0, momentum=0.999, nu=0.7, weight_decay=1e-4,
    decoupled_weight_decay=True,
)  # fmt: skip
print("decoupled (pyt, torch):", old.defaults["decoupled_weight_decay"],
      new.defaults["decoupled_weight_decay"])  # fmt: skip
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    qhoptim.torch.QHAdam(model.parameters(), weight_decay=1e-4, decouple_weight_decay=True)
print("qhoptim.torch on decouple_weight_decay:", sorted({w.category.__name__ for w in caught}))

# QHAdamW's default weight decay: 1.1.0's 0 in qhoptim.pyt, AdamW's in qhoptim.torch.
for module in (qhoptim.pyt, qhoptim.torch):
    default = module.QHAdamW(model.parameters()).defaults["weight_decay"]
    print(f"{module.__name__}.QHAdamW default weight_decay:", default)

# From a conversion to an optimizer in one call.
opt = qhoptim.torch.QHM.from_params(
    model.parameters(), convert.from_pid(k_p=-0.1, k_i=1.0, k_d=3.0)
)
print("from_params:", {k: round(opt.defaults[k], 6) for k in ("lr", "momentum", "nu")})

# Checkpoints: state_dict / load_state_dict as for any torch optimizer (a 1.1.0
# QHAdam state is converted on load, see docs/torch.md).
kwargs = {"lr": 1e-3, "nus": (0.7, 1.0), "betas": (0.995, 0.999), "weight_decay": 0.0}
opt = qhoptim.torch.QHAdamW(model.parameters(), **kwargs)
model(torch.randn(8, 4)).square().mean().backward()
opt.step()
restored = qhoptim.torch.QHAdamW(model.parameters(), **kwargs)
restored.load_state_dict(opt.state_dict())
print("state keys:", sorted(restored.state[model.weight]))
