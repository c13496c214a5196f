"""Automatic mixed precision for unmodified JAX models (``zf.autocast``).

    f16 = zf.autocast(fn, dtype="bf16")                       # same signature, same output dtypes
    f16 = zf.autocast(fn, dtype="bf16", policy=zf.AutocastPolicy(fp32_scopes=("router",)))
    print(zf.autocast_report(fn, *args, dtype="bf16"))         # every decision and its reason
    grad_fn = zf.scaled_value_and_grad(loss_fn, zf.Precision(loss_scale="dynamic", autocast="fp16"))

``fn`` is traced to a jaxpr, painted (``paint.py``: the allow / fp32 / follow / neutral lists
of ``lists.py`` and the bytes cost model of ``cost.py``) and replayed with the planned casts
(``interpret.py``, ``higher_order.py``). ``report.py`` prints the decisions; ``scaling.py``
holds loss scaling for use outside the engine. Details: ``docs/autocast.md``.
"""

# higher_order registers the painters and runners of loops, conditionals, calls, remat and
# custom rules with paint and interpret, which look them up by primitive name.
from zeroflow.autocast import higher_order  # noqa: F401
from zeroflow.autocast.interpret import autocast
from zeroflow.autocast.policy import AutocastPolicy
from zeroflow.autocast.report import AutocastReport, autocast_report
from zeroflow.autocast.scaling import scaled_value_and_grad

__all__ = [
    "autocast",
    "AutocastPolicy",
    "autocast_report",
    "AutocastReport",
    "scaled_value_and_grad",
]
