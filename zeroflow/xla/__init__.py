"""What XLA says about a compiled step: its HLO text (``hlo``: computations, loop trip counts,
types and sizes, a collective's device groups), its collectives (``collectives``: what each
moves, whether it overlaps compute, the traffic per step) and XLA:GPU's own estimate of its time
(``schedule``: the latency-hiding scheduler's statistics). Memory planning, the planner, the
experiments and the engine's tests all read them; ``zf.memory`` names the public ones
(``zf.memory.collectives``, ``overlap``, ``traffic``, ``Collective``, ``StepTime``). Importing
this package imports nothing: each module is imported where it is used.
"""
