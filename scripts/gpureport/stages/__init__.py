"""The report's stages, in the order they run. Each module has ``TITLE``, ``plan(ctx)`` (a
generator of ``runner.Item``/``runner.Summary``, sent each item's ``runner.Outcome``) and
``render(records) -> list[str]`` (its markdown section, from all records so far)."""
from gpureport.stages import autocast, correctness, env, kernels, memory, offload, training

STAGES = {"env": env, "correctness": correctness, "kernels": kernels, "training": training,
          "memory": memory, "offload": offload, "autocast": autocast}
