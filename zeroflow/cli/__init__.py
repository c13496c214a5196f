"""The command-line programs, together: ``python -m zeroflow.train`` (``train``),
``zeroflow.sample``, ``zeroflow.export``, ``zeroflow.launch`` and ``zeroflow.memory``
(``memory``), with the shared one-line-error plumbing (``common``). The modules of the same names
at the root of ``zeroflow/`` only start these."""
