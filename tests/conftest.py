"""Test setup: 8 emulated CPU devices, set before jax is imported anywhere."""
import os

# The two compile flags make XLA:CPU skip its expensive optimisation passes: the tests check
# numerics and sharding, not CPU speed, and compiling is most of their time.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
