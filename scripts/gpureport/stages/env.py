"""Stage env: the accelerator as jax sees it, package versions, and a bf16 matmul probe."""
from __future__ import annotations

from gpureport.runner import Context, Item
from gpureport.tables import good, num, of_stage, size

TITLE = "Environment"


def plan(ctx: Context):
    yield Item("environment", "benchlib.hardware:environment", {"matmul_size": ctx.profile.matmul_size},
               timeout_s=180, case_timeout_s=170, min_s=5)


def render(records: list[dict]) -> list[str]:
    found = good(of_stage(records, "env"))
    if not found:
        return ["_No environment record._"]
    env = found[0]["result"]
    achieved = env.get("matmul_bf16_flops")
    peak = env.get("peak_bf16_flops")
    share = f" ({achieved / peak:.0%} of the peak below)" if achieved and peak else ""
    packages = ", ".join(f"{name} {version}" for name, version in env.get("packages", {}).items())
    return [
        f"- device: **{env['device_kind']}** x{env['device_count']} (jax backend `{env['backend']}`), "
        f"allocator limit {size(env.get('bytes_limit'))}",
        f"- jax {env['jax']}, jaxlib {env['jaxlib']}, python {env['python']}, {env['platform']}",
        f"- bf16 peak used for MFU: {num(peak and peak / 1e12, '{:.1f}')} TFLOP/s "
        f"({env.get('peak_source') or 'device not in the table: no MFU'})",
        f"- bf16 {env['matmul_size']}^3 matmul reaches {num(achieved and achieved / 1e12, '{:.1f}')} "
        f"TFLOP/s{share}",
        f"- default matmul precision: {env.get('default_matmul_precision') or 'default (XLA decides)'}",
        f"- packages: {packages}",
    ]
