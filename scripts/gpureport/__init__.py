"""The GPU report: every GPU measurement zeroflow reports, in one time-limited command.

``scripts/gpu_report.py`` is the command; ``profiles`` says what is measured, ``stages/`` how
each stage plans its items and renders its section, ``runner`` runs the items (each in its own
process, within time budgets), ``files`` keeps the report on disk current, ``render`` and
``targets`` turn records into the markdown report and its headline table. docs/gpu_report.md
explains how to run it.
"""
