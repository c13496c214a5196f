"""The report's stages, in the order they run. Each module has ``TITLE``, ``plan(ctx)`` (a
generator of ``runner.Item``/``runner.Summary``, sent each item's ``runner.Outcome``) and
``render(records) -> list[str]`` (its markdown section, from all records so far)."""
from gpureport.stages import autocast, correctness, env, fp8, kernels, memory, offload, training

STAGES = {"env": env, "correctness": correctness, "kernels": kernels, "training": training,
          "fp8": fp8, "memory": memory, "offload": offload, "autocast": autocast}
