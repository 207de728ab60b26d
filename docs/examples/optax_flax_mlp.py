# requires: flax, optax, qhoptim.optax
"""Train a small Flax (linen) MLP with QHAdam from qhoptim.optax.

Run it directly (``python docs/examples/optax_flax_mlp.py``); the test suite
executes it too.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import qhoptim.optax as qho


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.tanh(nn.Dense(32)(x))
        return nn.Dense(1)(x)


def make_data(n: int = 512) -> tuple[jax.Array, jax.Array]:
    # A smooth 2-D regression target with a little noise, generated here.
    kx, kn = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.uniform(kx, (n, 2), minval=-2.0, maxval=2.0)
    y = jnp.sin(x[:, :1]) * jnp.cos(x[:, 1:]) + 0.05 * jax.random.normal(kn, (n, 1))
    return x, y


def train(steps: int = 300) -> list[float]:
    x, y = make_data()
    model = MLP()
    params = model.init(jax.random.PRNGKey(1), x[:1])
    # The paper's QH default (nu1 = 0.7, beta1 = 0.999), behind a clipping step.
    tx = optax.chain(optax.clip_by_global_norm(1.0), qho.qhadam(1e-2, b1=0.999, nu1=0.7))
    opt_state = tx.init(params)

    def loss_fn(p: optax.Params) -> jax.Array:
        return jnp.mean((model.apply(p, x) - y) ** 2)

    @jax.jit
    def step(p: optax.Params, s: optax.OptState) -> tuple[optax.Params, optax.OptState, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return losses


if __name__ == "__main__":
    history = train()
    print(f"loss {history[0]:.4f} -> {history[-1]:.4f}")
