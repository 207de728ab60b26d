# requires: optax, qhoptim.optax
"""optax.sgd / optax.adam to qhoptim.optax: same trajectory, then the paper's start."""

import jax

jax.config.update("jax_enable_x64", True)  # compare in float64

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import qhoptim.optax as qho  # noqa: E402
from qhoptim import convert  # noqa: E402

kx, kw = jax.random.split(jax.random.PRNGKey(0))
X = jax.random.normal(kx, (128, 6), dtype=jnp.float64)
Y = jnp.sin(X @ jax.random.normal(kw, (6,), dtype=jnp.float64))


def loss_fn(p):
    return jnp.mean((jnp.tanh(X @ p["w1"]) @ p["w2"] - Y) ** 2)


def train(tx, steps=50):
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    params = {
        "w1": 0.5 * jax.random.normal(k1, (6, 16), dtype=jnp.float64),
        "w2": 0.5 * jax.random.normal(k2, (16,), dtype=jnp.float64),
    }
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        updates, s = tx.update(jax.grad(loss_fn)(p), s, p)
        return optax.apply_updates(p, updates), s

    for _ in range(steps):
        params, state = step(params, state)
    return jnp.concatenate([params["w1"].ravel(), params["w2"]])


def compare(name, theirs, ours):
    a, b = train(theirs), train(ours)
    diff = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
    print(f"{name:46s} max rel. difference {diff:.1e}")
    assert diff < 1e-12, diff


# optax.sgd keeps an unnormalized trace (as torch): divide lr by (1 - momentum).
p = convert.from_nesterov(lr=0.1, momentum=0.9)
compare(
    "optax.sgd(0.1, momentum=0.9, nesterov=True)",
    optax.sgd(0.1, momentum=0.9, nesterov=True),
    qho.qhm(p.lr, momentum=p.momentum, nu=p.nu),
)
p = convert.from_momentum(lr=0.05, momentum=0.95)
compare(
    "optax.sgd(0.05, momentum=0.95)",
    optax.sgd(0.05, momentum=0.95),
    qho.qhm(p.lr, momentum=p.momentum, nu=p.nu),
)
# optax.adam adds eps after bias correction, as the paper: nus = (1, 1) is exact.
compare("optax.adam(1e-2)", optax.adam(1e-2), qho.qhadam(1e-2, nu1=1.0, nu2=1.0))
compare(
    "optax.adamw(1e-2, weight_decay=1e-2)",
    optax.adamw(1e-2, weight_decay=1e-2),
    qho.qhadamw(1e-2, weight_decay=1e-2),
)

# The paper's starting points: QHM nu = 0.7, momentum = 0.999 at the converted
# lr; QHAdam nu1 = 0.7, b1 = 0.999, the rest as in Adam. Tune from there.
start_qhm = qho.qhm(convert.from_nesterov(0.1, 0.9).lr, momentum=0.999, nu=0.7)
start_qhadam = qho.qhadam(1e-2, b1=0.999, nu1=0.7)
