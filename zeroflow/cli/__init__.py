"""The command-line programs, together: ``python -m zeroflow.train`` (``train``),
``zeroflow.sample``, ``zeroflow.export``, ``zeroflow.launch``, ``zeroflow.memory`` (``memory``)
and ``zeroflow.planner`` (``planner``), with the shared plumbing (``common``). The modules of the
same names at the root of ``zeroflow/`` only start these.

A ``python -m zeroflow.<command>`` process is prepared before anything imports jax
(``common.start_command``: signals, a quiet jax, the commands' warning lines), by
``zeroflow/__init__.py``, the first code such a process runs.
"""
