import jax

# float64 cases need x64; float32/bf16 tests pass explicit dtypes.
jax.config.update("jax_enable_x64", True)
