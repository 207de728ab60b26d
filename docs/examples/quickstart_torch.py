# requires: torch, qhoptim.torch
"""PyTorch in 30 seconds: QHM with the paper's rule of thumb on a small regression."""

import torch

from qhoptim.torch import QHM

torch.manual_seed(0)
x = torch.randn(256, 8)
y = x @ torch.randn(8, 1) + 0.1 * torch.randn(256, 1)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 32),
    torch.nn.Tanh(),
    torch.nn.Linear(32, 1),
)

# nu = 0.7, momentum (beta) = 0.999; lr = 0.1 here is the *effective* step size.
optimizer = QHM(model.parameters(), lr=0.1, momentum=0.999, nu=0.7)

for step in range(201):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    if step % 50 == 0:
        print(f"step {step:3d}  loss {loss.item():.4f}")
