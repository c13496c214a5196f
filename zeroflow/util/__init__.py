"""What every layer of zeroflow uses and that knows nothing of training: the jax-version
differences (``compat``), jaxpr interpretation (``jaxprs``), key-path helpers (``tree``) and a
quiet jax start (``quiet_jax``) and the commands' start-up signal handling (``interrupts``)."""
