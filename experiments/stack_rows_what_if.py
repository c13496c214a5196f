"""What if zeroflow split a stack of matrices (``[layers, in, out]``, three or more dimensions)
along each layer's rows (its second dimension) whenever they divide by the data axis, as it
splits a lone matrix, instead of along its largest dimension?

A stack split along its last dimension (the Llama shape's ``w1``/``w3``, ``[layers, d, ffn]``)
is gathered one layer at a time on a new leading axis and moved into place, and its gradient
moved back before the reduction; split by rows, a layer's slice is gathered along its major
dimension and needs neither move. This compiles stage 3 of ``experiments/vs_gspmd.py``'s rows
with ``ZeroPlan.leaf_layout`` patched to that rule (in this process only) and prints each row
as ``vs_gspmd`` would, to compare with its results file:

    python experiments/stack_rows_what_if.py 1b:full:xla 8b:full:cudnn
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rows_first(original):
    def leaf_layout(self, path, shape, *, tensor_rules=True):
        lay = original(self, path, shape, tensor_rules=tensor_rules)
        shape = tuple(int(d) for d in shape)
        if (len(shape) >= 3 and lay.zero_dim not in (None, 1) and lay.tensor_spec[1] is None
                and shape[1] % self.data_size == 0):
            return dataclasses.replace(lay, zero_dim=1, pad=0)
        return lay
    return leaf_layout


def main(argv: list[str]) -> int:
    if "--row" in argv:  # the child: patched, then compiled as vs_gspmd compiles a row
        from zeroflow.engine.plan import ZeroPlan
        ZeroPlan.leaf_layout = _rows_first(ZeroPlan.leaf_layout)
        import vs_gspmd
        print(json.dumps(vs_gspmd.compile_row(json.loads(argv[argv.index("--row") + 1]))))
        return 0
    import subprocess

    import vs_gspmd
    for spec in argv:
        shape, remat, attention = spec.split(":")
        row = {"target": "h100", "shape": shape, "remat": remat, "devices": 8,
               "system": "stage3", "attention": attention}
        out = subprocess.run([sys.executable, __file__, "--row", json.dumps(row)],
                             env=vs_gspmd._child_env(), capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        result = json.loads(lines[-1]) if lines else {**row, "note": out.stderr[-300:]}
        print(spec, vs_gspmd._progress(0, 0, result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
