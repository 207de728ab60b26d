# requires: optax, qhoptim.optax
"""optax in 30 seconds: QHAdam as a gradient transformation, jitted."""

import jax
import jax.numpy as jnp
import optax

import qhoptim.optax as qho

kx, kw, kn = jax.random.split(jax.random.PRNGKey(0), 3)
x = jax.random.normal(kx, (256, 8))
y = x @ jax.random.normal(kw, (8,)) + 0.1 * jax.random.normal(kn, (256,))
params = {"w": jnp.zeros(8), "b": jnp.zeros(())}

tx = qho.qhadam(learning_rate=3e-2, b1=0.999, nu1=0.7)  # nu2 = 1, b2 = 0.999: Adam's
opt_state = tx.init(params)


def loss_fn(p):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


@jax.jit
def step(p, s):
    loss, grads = jax.value_and_grad(loss_fn)(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss


for i in range(401):
    params, opt_state, loss = step(params, opt_state)
    if i % 100 == 0:
        print(f"step {i:3d}  loss {float(loss):.4f}")
