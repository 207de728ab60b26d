# requires: keras, qhoptim.keras
"""Keras 3 in 30 seconds: QHAdam in model.compile (any Keras backend)."""

import keras
import numpy as np

from qhoptim.keras import QHAdam

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.standard_normal((256, 8)).astype("float32")
y = x @ rng.standard_normal((8, 1)).astype("float32")

model = keras.Sequential(
    [
        keras.Input((8,)),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(1),
    ]
)
optimizer = QHAdam(learning_rate=1e-2, beta_1=0.999, nu_1=0.7)  # nu_2 = 1: Adam's
model.compile(optimizer=optimizer, loss="mse")
history = model.fit(x, y, epochs=20, batch_size=32, verbose=0)
losses = history.history["loss"]
print(f"backend {keras.backend.backend()}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
