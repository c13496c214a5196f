"""The engine: the sharded training state and the step that updates it.

Where every array lives (``plan``, ``padding``, ``precision``, ``mesh``), the state built in that
layout (``state``, ``frozen``, ``opt_mirror``), the step (``step``, ``update``, ``offload``,
``grads/``, ``zeropp/``) and checkpoints that load onto any layout (``checkpoint``,
``checkpoint_digests``). The engine imports no trainer, CLI, config, model or data module
(tests/test_import_graph.py holds it to that); its public names are re-exported by ``zeroflow``.
"""
