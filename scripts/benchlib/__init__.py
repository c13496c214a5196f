"""Measurement code shared by the benchmark scripts and the GPU report (``scripts/gpu_report.py``).

``isolate``: run one measurement in a fresh process (an OOM, a compiler crash or a hang costs
that measurement only). ``timing``: medians of synchronised calls. ``attention`` /
``block_sparse``: kernel checks and timings. ``gpt``: one GPT training configuration measured
(step time, MFU, compiled and allocated memory, the estimator's figure). ``search``: the
largest-model search. ``hardware``: what machine this is and its peak FLOP/s.

Functions that run in a child process take and return plain JSON values.
"""
