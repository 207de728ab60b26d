# requires: keras, qhoptim.keras
"""Moving keras.optimizers.SGD / Adam settings to qhoptim.keras.

Keras's SGD keeps an unnormalized velocity (as torch), so QHM's learning rate is
``lr / (1 - momentum)``: ``QHM.from_params(qhoptim.convert.from_nesterov(...))``.
Keras's Adam adds its ``epsilon`` ("epsilon hat") to the *uncorrected* square
root; QHAdam adds it after bias correction, as the paper and Kingma & Ba's
Algorithm 1 do -- the two agree as epsilon -> 0, so the Adam comparison below
uses a tiny epsilon. The runs are float32 (Keras's default): they agree to
float32 rounding.
"""

import keras
import numpy as np

from qhoptim import convert
from qhoptim.keras import QHM, QHAdam

rng = np.random.default_rng(0)
X = rng.standard_normal((128, 6)).astype("float32")
Y = np.sin(X @ rng.standard_normal((6, 1))).astype("float32")


def train(optimizer, epochs=10):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(X, Y, epochs=epochs, batch_size=32, shuffle=False, verbose=0)
    return np.concatenate([w.ravel() for w in model.get_weights()])


def compare(name, theirs, ours):
    a, b = train(theirs), train(ours)
    diff = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
    print(f"{name:48s} max rel. difference {diff:.1e}")
    assert diff < 1e-5, diff


compare(
    "SGD(0.1, momentum=0.9, nesterov=True)",
    keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    QHM.from_params(convert.from_nesterov(lr=0.1, momentum=0.9)),
)
compare(
    "SGD(0.05, momentum=0.95)",
    keras.optimizers.SGD(0.05, momentum=0.95),
    QHM.from_params(convert.from_momentum(lr=0.05, momentum=0.95)),
)
compare(
    "Adam(1e-2, epsilon=1e-12)",
    keras.optimizers.Adam(1e-2, epsilon=1e-12),
    QHAdam.from_params(convert.from_adam(1e-2, (0.9, 0.999), 1e-12)),
)

# The paper's starting points. weight_decay is Keras's decoupled decay on all
# qhoptim.keras optimizers, as on Keras's own.
lr = convert.from_nesterov(0.1, 0.9).lr
start_qhm = QHM(learning_rate=lr, momentum=0.999, nu=0.7)
start_qhadam = QHAdam(learning_rate=1e-2, beta_1=0.999, nu_1=0.7)
config = start_qhm.get_config()
print("QHM start:", {k: config[k] for k in ("learning_rate", "momentum", "nu")})
