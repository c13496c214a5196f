"""The headline table: each target of issue 14 (and issue 12's autocast goal, issue 55's FP8
speed), its measured value and whether it is met, computed from the records. "not measured"
when the items did not run ("not applicable: why" for FP8 on a GPU without it)."""
from __future__ import annotations

import dataclasses
import statistics

from gpureport.stages import autocast, fp8, kernels, offload, training
from gpureport.tables import good, of_stage, params

ONE_B = 0.8e9
"A training run counts as '~1B' from this many parameters."


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    goal: str
    value: str = "not measured"
    met: bool | None = None


def kernels_correct(records: list[dict]) -> Target:
    name, goal = "Pallas kernels compiled on the device match the references", "every case passes"
    checks = good(of_stage(records, "correctness"))
    if not checks:
        return Target(name, goal)
    passed = [r for r in checks if r["result"]["passed"]]
    failed = [r["case"] for r in checks if not r["result"]["passed"]]
    value = f"{len(passed)}/{len(checks)} pass" + (f"; failing: {', '.join(failed)}" if failed else "")
    errors = [r for r in of_stage(records, "correctness") if r["status"] not in ("ok", "reused")]
    if errors:
        value += f"; {len(errors)} did not run to a result"
    return Target(name, goal, value, not failed and not errors)


def flash_vs_cudnn(records: list[dict]) -> Target:
    name = "flash attention vs cuDNN, D=128, S >= 8k (worst config, fwd+bwd)"
    goal = ">= 0.9x"
    ratios = [(impls["pallas"]["tflops"] / impls["cudnn"]["tflops"], key)
              for key, impls in kernels.attention_rows(records).items()
              if key[0] >= 8192 and key[1] == 128 and key[3] == "fwd+bwd"
              and "pallas" in impls and "cudnn" in impls]
    if not ratios:
        return Target(name, goal)
    worst, (seq, dim, causal, pass_) = min(ratios)
    median = statistics.median(r for r, _ in ratios)
    return Target(name, goal, f"{worst:.2f}x at S={seq} D={dim} {'causal' if causal else 'full'} {pass_} "
                              f"(median {median:.2f}x over {len(ratios)})", worst >= 0.9)


def block_sparse_90(records: list[dict]) -> Target:
    name, goal = "block-sparse at 90% sparsity vs dense (best block size, fwd and fwd+bwd)", ">= 5x"
    by_block: dict[int, dict[str, float]] = {}
    for row in kernels.block_sparse_speedups(records):
        if abs(row["sparsity"] - 0.9) < 1e-6 and row["speedup"]:
            by_block.setdefault(row["block"], {})[row["pass"]] = row["speedup"]
    complete = {b: s for b, s in by_block.items() if {"fwd", "fwd+bwd"} <= s.keys()}
    if not complete:
        return Target(name, goal)
    block, speed = max(complete.items(), key=lambda kv: min(kv[1].values()))
    worst = min(speed.values())
    return Target(name, goal, f"block {block}: fwd {speed['fwd']:.2f}x, fwd+bwd {speed['fwd+bwd']:.2f}x",
                  worst >= 5.0)


def mfu_1b(records: list[dict]) -> Target:
    name, goal = "MFU of the ~1B GPT, one device (best run)", ">= 45%"
    env = training.env_of(records)
    runs = [(*training.mfu(r["result"], env), r["item"]) for r in good(of_stage(records, "training"))
            if r["result"]["params"] >= ONE_B]
    runs = [run for run in runs if run[0] is not None]
    if not runs:
        return Target(name, goal)
    best, mark, item = max(runs)
    basis = " (* vs the measured bf16 matmul, the device is not in the peak table)" if mark else ""
    return Target(name, goal, f"{best:.1%}{mark} ({item}){basis}", best >= 0.45)


def offload_ratio(records: list[dict]) -> Target:
    name, goal = "optimizer offload step time / no offload, ~1B (best of update on device/host)", "<= 1.5x"
    rows = {row["item"]: row["ratio"] for row in offload.ratio_rows(records) if row["ratio"] is not None}
    found = {k.removeprefix(offload.RATIO + " "): v for k, v in rows.items()
             if k.startswith(f"{offload.RATIO} optimizer/")}
    if not found:
        return Target(name, goal)
    best = min(found.values())
    return Target(name, goal, ", ".join(f"{k} {v:.2f}x" for k, v in found.items()), best <= 1.5)


def largest_ratio(records: list[dict]) -> Target:
    name, goal = "largest trainable GPT with offload / without (parameters)", ">= 2x"
    rows = {(r["offload"], r["update_on"]): r for r in offload.largest_rows(records)}
    base = rows.get(("none", "device"))
    others = [r for key, r in rows.items() if key[0] != "none" and r["largest_params"]]
    if not base or not base["largest_params"] or not others:
        return Target(name, goal)
    best = max(others, key=lambda r: r["largest_params"])
    ratio = best["largest_params"] / base["largest_params"]
    return Target(name, goal, f"{ratio:.2f}x ({params(best['largest_params'])} with {best['offload']}/"
                              f"{best['update_on']} vs {params(base['largest_params'])})", ratio >= 2.0)


def autocast_speed(records: list[dict]) -> Target:
    name, goal = "autocast bf16 tokens/s vs fp32 and vs hand bf16 (issue 12)", ">= 1.4x and >= 0.95x"
    res = autocast.speedups(records).get("autocast bf16")
    if not res or res["vs_fp32"] is None or res["vs_hand_bf16"] is None:
        return Target(name, goal)
    return Target(name, goal, f"{res['vs_fp32']:.2f}x fp32, {res['vs_hand_bf16']:.2f}x hand bf16",
                  res["vs_fp32"] >= 1.4 and res["vs_hand_bf16"] >= 0.95)


def _fp8_not_measured(records: list[dict], name: str, goal: str) -> Target:
    """"not applicable: why" on a GPU without FP8 tensor cores, else "not measured"."""
    note = fp8.not_applicable_note(records)
    return Target(name, goal, note) if note else Target(name, goal)


def fp8_gemm(records: list[dict]) -> Target:
    name, goal = "FP8 GEMM (e4m3 x e4m3, operands in e4m3) vs bf16, forward", ">= 1.6x"
    rows = [row for row in fp8.gemm_rows(records) if row["pass"] == "fwd" and "e4m3" in row]
    if not rows:
        return _fp8_not_measured(records, name, goal)
    row = max(rows, key=lambda r: r["size"])
    raw, scaled = row["e4m3"]["speedup"], row.get("scaled_dot", {}).get("speedup")
    value = f"{raw:.2f}x at {row['size']}^3 ({row['e4m3']['tflops']:.0f} TFLOP/s)"
    if scaled is not None:
        value += f"; with the bf16 operands' casts (scaled_dot) {scaled:.2f}x"
    return Target(name, goal, value, raw >= 1.6)


def fp8_step(records: list[dict]) -> Target:
    name = "FP8 step tokens/s vs bf16 autocast, ~1B GPT (issue 55; torchao: +25%)"
    goal = ">= 1.2x"
    res = fp8.step_result(records)
    if res is None:
        return _fp8_not_measured(records, name, goal)
    others = {label: var["speedup"] for label, var in res["variants"].items() if label != res["baseline"]}
    if not others:
        return Target(name, goal)
    value = ", ".join(f"{label} {speedup:.2f}x" for label, speedup in others.items())
    return Target(name, goal, value, max(others.values()) >= 1.2)


CHECKS = (kernels_correct, flash_vs_cudnn, block_sparse_90, mfu_1b, offload_ratio, largest_ratio,
          autocast_speed, fp8_gemm, fp8_step)


def evaluate(records: list[dict]) -> list[Target]:
    out = []
    for check in CHECKS:
        try:
            out.append(check(records))
        except Exception as err:  # a malformed record must not cost the whole table
            out.append(Target(check.__name__, "", f"could not compute: {type(err).__name__}: {err}"))
    return out
