"""Run one measurement item in a fresh Python process and read back what it got.

A report run is time-limited, so nothing one measurement does may cost the others: an
out-of-memory error, a Triton compile crash, a segfault or a hang in one item costs that item
only. The parent (``run_isolated``) starts ``python -m benchlib.isolate`` with a target
``"module:function"`` (or ``"path/to/file.py:function"``) and JSON keyword arguments. The
target either returns a dict (one result) or is a generator of ``Case(name, run)``: the
child then runs each case in turn, catching exceptions per case. Every case's start and end
are appended to a JSONL file and flushed as they happen, so when the child dies the parent
knows which case was in flight; it can start the child again with ``skip=`` the cases already
done. The parent also kills a case that runs longer than ``case_timeout_s``.

Each child also owns the accelerator alone while it runs: the parent never starts a jax
backend, so a child's memory peak (``device.memory_stats()``) is its own.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from benchlib.errors import first_line, is_oom

SCRIPTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = SCRIPTS_DIR.parent
SINGLE = ""
"Case name of a target that returns one dict; the parent names it after the item."
_POLL_S = 0.25
_TAIL_LINES = 40


class Case(NamedTuple):
    """One measurement inside an item: ``run()`` returns a JSON-able dict."""
    name: str
    run: Callable[[], dict]


@dataclasses.dataclass(frozen=True)
class CaseOutcome:
    case: str
    status: str  # ok | error | oom | timeout | crash
    seconds: float
    result: dict | None = None
    error: str | None = None
    detail: str | None = None  # traceback, or the tail of the child's output


@dataclasses.dataclass(frozen=True)
class ItemOutcome:
    cases: list[CaseOutcome]
    finished: bool  # the child got through all its cases
    returncode: int | None
    log_tail: str = ""


# --------------------------------------------------------------------------- parent side
def child_env(extra: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the repository and ``scripts/``
    importable, updated with ``extra``."""
    env = dict(os.environ if base is None else base)
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [str(REPO_ROOT), str(SCRIPTS_DIR), *inherited]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(extra or {})
    return env


def run_isolated(target: str, kwargs: dict, *, workdir: Path, timeout_s: float,
                 case_timeout_s: float | None = None, skip: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> ItemOutcome:
    """Run ``target(**kwargs)`` in a child process; never raises for anything the child does."""
    workdir.mkdir(parents=True, exist_ok=True)
    stem = f"item-{time.monotonic_ns()}"
    kwargs_path, result_path, log_path = (workdir / f"{stem}{ext}" for ext in (".json", ".jsonl", ".log"))
    kwargs_path.write_text(json.dumps(kwargs))
    cmd = [sys.executable, "-m", "benchlib.isolate", "--target", target, "--kwargs", str(kwargs_path),
           "--result", str(result_path)]
    for name in skip:
        cmd += ["--skip", name]
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or child_env(),
                                cwd=REPO_ROOT, start_new_session=True)
        killed_for = _wait(proc, result_path, start + timeout_s, case_timeout_s)
    events = _read_events(result_path)
    tail = _tail(log_path)
    return ItemOutcome(cases=_outcomes(events, proc.returncode, killed_for, tail),
                       finished=any(e.get("event") == "done" for e in events),
                       returncode=proc.returncode, log_tail=tail)


def _wait(proc: subprocess.Popen, result_path: Path, deadline: float,
          case_timeout_s: float | None) -> str | None:
    """Wait for the child; kill it at the deadline or when one case overruns. Returns why it
    was killed (None if it exited by itself)."""
    while proc.poll() is None:
        now = time.monotonic()
        if now >= deadline:
            _kill(proc)
            return "item time limit"
        if case_timeout_s is not None:
            started = _case_in_flight_since(result_path)
            if started is not None and time.time() - started > case_timeout_s:
                _kill(proc)
                return f"case time limit ({case_timeout_s:.0f} s)"
        time.sleep(_POLL_S)
    return None


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and anything it started
    except ProcessLookupError:
        pass
    proc.wait()


def _case_in_flight_since(result_path: Path) -> float | None:
    events = _read_events(result_path)
    if events and events[-1].get("event") == "start":
        return events[-1]["time"]
    return None


def _read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            break
    return events


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-_TAIL_LINES:])


def exit_description(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _last_error_line(tail: str) -> str:
    """The line of the child's output most likely to name the failure."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error:" in line or "Exception" in line or "Fatal" in line:
            return line[:300]
    return lines[-1][:300] if lines else ""


def _outcomes(events: list[dict], returncode: int | None, killed_for: str | None,
              tail: str) -> list[CaseOutcome]:
    outcomes, open_case = [], None
    for event in events:
        kind = event.get("event")
        if kind == "start":
            open_case = event
        elif kind in ("ok", "error", "oom"):
            outcomes.append(CaseOutcome(case=event["case"], status=kind, seconds=event["seconds"],
                                        result=event.get("result"), error=event.get("error"),
                                        detail=event.get("detail")))
            open_case = None
    if open_case is not None:  # the child died or was killed inside this case
        status = "timeout" if killed_for else "crash"
        why = killed_for or exit_description(returncode)
        line = _last_error_line(tail)
        outcomes.append(CaseOutcome(case=open_case["case"], status=status,
                                    seconds=time.time() - open_case["time"],
                                    error=f"{why}" + (f"; last output: {line}" if line else ""),
                                    detail=tail))
    elif not outcomes and (returncode or killed_for):  # died before its first case
        outcomes.append(CaseOutcome(case=SINGLE, status="timeout" if killed_for else "crash", seconds=0.0,
                                    error=f"{killed_for or exit_description(returncode)}: "
                                          f"{_last_error_line(tail)}", detail=tail))
    return outcomes


# --------------------------------------------------------------------------- child side
def load_target(target: str) -> Callable:
    """``"package.module:function"`` or ``"path/to/file.py:function"``."""
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise ValueError(f"target must be 'module:function' or 'file.py:function', got {target!r}")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item") and callable(x.item):  # numpy / jax scalars
        return x.item()
    if isinstance(x, (set, frozenset, tuple)):
        return list(x)
    return str(x)


class _Events:
    """Appends one JSON line per event and forces it to disk before going on."""

    def __init__(self, path: str):
        self._file = open(path, "a")

    def write(self, **event) -> None:
        event["time"] = time.time()
        self._file.write(json.dumps(event, default=_jsonable) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())


def _record_failure(events: _Events, name: str, seconds: float, err: Exception) -> None:
    text = f"{type(err).__name__}: {err}"
    print(f"case {name!r} failed: {first_line(text)}", flush=True)
    events.write(event="oom" if is_oom(text) else "error", case=name, seconds=seconds,
                 error=first_line(text), detail=traceback.format_exc()[-20000:])


def _run_case(events: _Events, name: str, run: Callable[[], dict]) -> None:
    events.write(event="start", case=name)
    start = time.perf_counter()
    try:
        result = run()
    except Exception as err:  # recorded, and the next case runs
        _record_failure(events, name, time.perf_counter() - start, err)
        return
    events.write(event="ok", case=name, seconds=time.perf_counter() - start, result=result)


def child_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run one isolated measurement item")
    parser.add_argument("--target", required=True)
    parser.add_argument("--kwargs", required=True, help="JSON file of keyword arguments")
    parser.add_argument("--result", required=True, help="JSONL file the events are appended to")
    parser.add_argument("--skip", action="append", default=[], help="case names not to run")
    args = parser.parse_args(argv)
    events = _Events(args.result)
    kwargs = json.loads(Path(args.kwargs).read_text())
    skip = set(args.skip)
    fn = load_target(args.target)
    if not inspect.isgeneratorfunction(fn):
        _run_case(events, SINGLE, lambda: fn(**kwargs))
    else:
        cases = fn(**kwargs)
        while True:
            try:  # building the next case (inputs, shapes) can fail too
                case = next(cases)
            except StopIteration:
                break
            except Exception as err:
                events.write(event="start", case="(setup)")
                _record_failure(events, "(setup)", 0.0, err)
                break
            if case.name not in skip:
                print(f"case {case.name}", flush=True)
                _run_case(events, case.name, case.run)
    events.write(event="done")
    return 0


if __name__ == "__main__":
    from zeroflow.cli.common import start_script

    start_script()  # before the target imports jax: no CUDA-plugin noise where it has no driver
    sys.exit(child_main())
