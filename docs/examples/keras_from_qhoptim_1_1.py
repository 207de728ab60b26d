# requires: keras, qhoptim.keras
"""qhoptim 1.1.0's TensorFlow 1 optimizers (``qhoptim.tf``) become Keras 3 optimizers.

1.1.0's ``qhoptim.tf.QHMOptimizer`` / ``QHAdamOptimizer`` were ``tf.train``
optimizers, which TensorFlow 2 no longer has. ``qhoptim.keras.QHM`` / ``QHAdam``
take the same hyperparameters under Keras's argument names and run on any Keras
3 backend; ``minimize(loss)`` becomes ``model.compile(optimizer=...)`` or
``optimizer.apply(grads, variables)``.
"""

import keras
import numpy as np

from qhoptim import convert
from qhoptim.keras import QHM, QHAdam

# 1.1.0: qhoptim.tf.QHMOptimizer(learning_rate=1.0, momentum=0.999, nu=0.7)
qhm = QHM(learning_rate=1.0, momentum=0.999, nu=0.7)
# 1.1.0: qhoptim.tf.QHAdamOptimizer(learning_rate=1e-3, beta1=0.995, beta2=0.999,
#                                   nu1=0.7, nu2=1.0, epsilon=1e-8)
qhadam = QHAdam(learning_rate=1e-3, beta_1=0.995, beta_2=0.999, nu_1=0.7, nu_2=1.0, epsilon=1e-8)
# 1.1.0: QHMOptimizer(**QHMOptimizer.from_pid(k_p, k_i, k_d))
pid = QHM.from_params(convert.from_pid(k_p=-0.1, k_i=1.0, k_d=3.0))
print(
    "from_pid:",
    {
        k: round(v, 6)
        for k, v in pid.get_config().items()
        if k in ("learning_rate", "momentum", "nu")
    },
)

# One step by hand, as tf.train's apply_gradients did.
w = keras.Variable(np.ones(3, dtype="float32"))
qhadam.apply([keras.ops.convert_to_tensor(np.array([0.5, -1.0, 2.0], dtype="float32"))], [w])
print("after one QHAdam step:", np.round(keras.ops.convert_to_numpy(w), 6))
