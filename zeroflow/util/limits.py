"""Bounds on integers the user gives, shared by the config and the command lines."""

INT_LIMIT = 2**63
"Integers a config holds: what numpy and XLA take as int64."
SEED_MAX = 2**32 - 1
"JAX keys take 32 bits of a seed (without x64): a larger seed would repeat a smaller one's draws."
STEP_MAX = 2**31 - 1
"The train state's step counter is a 32-bit integer."
