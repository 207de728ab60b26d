# requires: mlx, sklearn, qhoptim.mlx
"""Train an mlx.nn MLP on scikit-learn's 8x8 digits with QHAdam from qhoptim.mlx.

The training step is ``mx.compile``d with the model's and the optimizer's
state as its inputs and outputs, as MLX documents. Run it directly
(``python docs/examples/mlx_digits.py``); the test suite executes it too.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import qhoptim.mlx as qhmlx


class MLP(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.layers = [nn.Linear(64, hidden), nn.Linear(hidden, 10)]

    def __call__(self, x: mx.array) -> mx.array:
        return self.layers[1](nn.relu(self.layers[0](x)))


def loss_fn(model: MLP, x: mx.array, y: mx.array) -> mx.array:
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def train(epochs: int = 20, batch_size: int = 64) -> tuple[list[float], float]:
    """Train; return the mean training loss of every epoch and the test accuracy."""
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.25, random_state=0)
    x_tr, x_te = mx.array(x_tr, dtype=mx.float32), mx.array(x_te, dtype=mx.float32)
    y_tr, y_te = mx.array(y_tr), mx.array(y_te)

    mx.random.seed(0)
    model = MLP()
    # The paper's QH default: nu1 = 0.7 with beta1 = 0.999; nu2 = 1 keeps Adam's denominator.
    optimizer = qhmlx.QHAdam(learning_rate=3e-3, betas=(0.999, 0.999), nus=(0.7, 1.0))
    optimizer.init(model.trainable_parameters())  # the state exists before compiling
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(xb: mx.array, yb: mx.array) -> mx.array:
        loss, grads = nn.value_and_grad(model, loss_fn)(model, xb, yb)
        optimizer.update(model, grads)
        return loss

    order = np.random.default_rng(0)
    losses = []
    for _ in range(epochs):
        perm = mx.array(order.permutation(x_tr.shape[0]))
        total = []
        for i in range(0, x_tr.shape[0], batch_size):
            idx = perm[i : i + batch_size]
            total.append(step(x_tr[idx], y_tr[idx]))
            mx.eval(state)
        losses.append(float(mx.mean(mx.stack(total))))
    accuracy = float(mx.mean(mx.argmax(model(x_te), axis=1) == y_te))
    return losses, accuracy


if __name__ == "__main__":
    history, acc = train()
    print(f"train loss {history[0]:.4f} -> {history[-1]:.4f}, test accuracy {acc:.3f}")
