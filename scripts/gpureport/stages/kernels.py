"""Stage kernels: TFLOP/s of our flash attention (Mosaic GPU, timed first) next to cuDNN's and
XLA's at head dim 128 and 4K-32K tokens, block-sparse matmul against dense, and a sweep of
attention tile sizes."""
from __future__ import annotations

from collections import defaultdict

from gpureport.runner import Context, Item
from gpureport.tables import good, num, of_stage, table

TITLE = "Kernels"
ATTENTION, BLOCK_SPARSE, TILES = "attention", "block-sparse matmul", "attention tiles"


def plan(ctx: Context):
    p = ctx.profile
    budget = p.budgets["kernels"]
    if p.attention_timing["configs"]:
        yield Item(ATTENTION, "benchlib.attention:timing_cases", p.attention_timing, timeout_s=budget,
                   case_timeout_s=90, min_s=10)
    if p.block_sparse_timing["block_sizes"]:
        yield Item(BLOCK_SPARSE, "benchlib.block_sparse:timing_cases", p.block_sparse_timing,
                   timeout_s=budget, case_timeout_s=90, min_s=10)
    tiles = p.attention_tiles
    for config in tiles["configs"]:
        kwargs = {"config": config, **{k: v for k, v in tiles.items() if k != "configs"}}
        yield Item(f"{TILES} S={config['seq']} D={config['head_dim']}", "benchlib.attention:tile_cases",
                   kwargs, timeout_s=budget, case_timeout_s=90, min_s=15)


def _item_results(records: list[dict], item: str) -> list[dict]:
    return [r["result"] for r in good(of_stage(records, "kernels")) if r["item"] == item]


def attention_rows(records: list[dict]) -> dict[tuple, dict[str, dict]]:
    """{(seq, head_dim, causal, pass): {impl: result}} from the attention timing records."""
    rows: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for res in _item_results(records, ATTENTION):
        rows[(res["seq"], res["head_dim"], res["causal"], res["pass"])][res["impl"]] = res
    return rows


def block_sparse_speedups(records: list[dict]) -> list[dict]:
    """One row per (block, sparsity, pass): sparse ms, dense ms, speedup."""
    results = _item_results(records, BLOCK_SPARSE)
    dense = {res["pass"]: res["ms"] for res in results if res["kind"] == "dense"}
    rows = []
    for res in results:
        if res["kind"] == "sparse":
            base = dense.get(res["pass"])
            rows.append({**res, "dense_ms": base, "speedup": base / res["ms"] if base else None})
    return rows


def _attention_table(records: list[dict]) -> list[str]:
    rows = []
    for (seq, dim, causal, pass_), impls in sorted(attention_rows(records).items()):
        tf = {name: impls[name]["tflops"] if name in impls else None for name in ("pallas", "cudnn", "xla")}
        ratio = tf["pallas"] / tf["cudnn"] if tf["pallas"] and tf["cudnn"] else None
        first = next(iter(impls.values()))
        rows.append([seq, dim, first["batch"], first["heads"], "causal" if causal else "full", pass_,
                     num(tf["pallas"], "{:.1f}"), num(tf["cudnn"], "{:.1f}"), num(tf["xla"], "{:.1f}"),
                     num(ratio, "{:.2f}x")])
    if not rows:
        return []
    return (["**Attention** (bf16; TFLOP/s counts 4·B·H·S²·D forward, half when causal, x3.5 "
             "forward+backward; median of timed calls)", ""]
            + table(["S", "D", "B", "H", "mask", "pass", "pallas", "cudnn", "xla", "pallas / cudnn"], rows)
            + [""])


def _block_sparse_table(records: list[dict]) -> list[str]:
    rows = [[r["block"], f"{r['sparsity']:.0%}", f"{r['kept_blocks']}/{r['total_blocks']}", r["pass"],
             num(r["dense_ms"], "{:.3f}"), f"{r['ms']:.3f}", num(r["speedup"], "{:.2f}x")]
            for r in block_sparse_speedups(records)]
    if not rows:
        return []
    return (["**Block-sparse matmul** vs a dense `jnp.dot` of the same shape (random layouts)", ""]
            + table(["block", "sparsity", "blocks kept", "pass", "dense ms", "sparse ms", "speedup"], rows)
            + [""])


def _tiles_table(records: list[dict]) -> list[str]:
    lines = []
    for r_item in sorted({r["item"] for r in of_stage(records, "kernels") if r["item"].startswith(TILES)}):
        results = _item_results(records, r_item)
        for pass_ in ("fwd", "fwd+bwd"):
            ranked = sorted((res for res in results if res["pass"] == pass_),
                            key=lambda res: -res["tflops"])
            if ranked:
                rows = [[", ".join(f"{k}={v}" for k, v in sorted(res["tuning"].items())),
                         f"{res['tflops']:.1f}", f"{res['ms']:.3f}"] for res in ranked]
                lines += [f"**{r_item}, {pass_}** (best first)", ""]
                lines += table(["TuningConfig", "TFLOP/s", "ms"], rows) + [""]
    return lines


def render(records: list[dict]) -> list[str]:
    return _attention_table(records) + _block_sparse_table(records) + _tiles_table(records)
