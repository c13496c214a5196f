"""What every layer of zeroflow uses and that knows nothing of training: the jax-version
differences (``compat``), jaxpr interpretation (``jaxprs``), key-path helpers (``tree``), the
values each setting accepts (``settings``, no jax), and for the commands only, a quiet jax
(``quiet_jax``) and the start-up signal handling (``interrupts``)."""
