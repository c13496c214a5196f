"""Drive the stages: run each item in its own process, within its stage's time budget and the
run's deadline, and hand every record to the report files the moment it exists.

A stage's ``plan(ctx)`` is a generator. It yields ``Item``s (one child process each) and
``Summary``s (a record computed in the parent, such as a search's answer) and is sent back each
item's ``Outcome``, so a stage can adapt to what it has measured (the largest-model search
does). Nothing a stage or an item does stops the run: a plan that raises is recorded as that
stage's error, an item that fails is recorded as that item's.
"""
from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

from benchlib.errors import describe
from benchlib.isolate import SINGLE, ItemOutcome, child_env, run_isolated

MAX_ATTEMPTS = 3
"Child starts per item: after a crash or a case timeout the rest of its cases get two more tries."
GOOD = ("ok", "reused")
BUDGET_SKIP = "skipped: time budget"
"How a record left for another call starts its note (render.next_command looks for it)."


@dataclasses.dataclass(frozen=True)
class Item:
    """One child process: ``target(**kwargs)`` in ``benchlib.isolate``."""
    name: str
    target: str
    kwargs: dict
    timeout_s: float = 600.0
    "The whole item, all attempts together."
    case_timeout_s: float | None = None
    "Kill the child when one case runs longer (a hang costs this much, not the item's budget)."
    min_s: float = 0.0
    "Not started with less time than this left in the stage or the run: it would not finish."
    key: str | None = None
    "Items with the same key measure the same thing; a later one reuses the earlier result."
    reuse_only: bool = False
    "Never run: reuse the result of an earlier item with the same key, or be left for later."


@dataclasses.dataclass(frozen=True)
class Summary:
    """A record computed by the stage itself, in the parent."""
    name: str
    result: dict | None = None
    status: str = "ok"
    note: str | None = None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a stage's plan is sent back for an item: its status and its records."""
    status: str
    records: list[dict]

    @property
    def result(self) -> dict | None:
        for record in self.records:
            if record["status"] in GOOD:
                return record.get("result")
        return None


@dataclasses.dataclass
class Context:
    """What a stage's plan may read: the profile, host facts and every record so far."""
    profile: Any
    host: dict
    records: list[dict]
    stages: tuple[str, ...] = ()
    "The stages this run was asked for."

    def env(self) -> dict | None:
        for record in self.records:
            if record["stage"] == "env" and record["status"] == "ok":
                return record["result"]
        return None


class Runner:
    def __init__(self, add_record: Callable[..., None], log: Callable[[str], None], *, deadline: float,
                 workdir: Path, child_vars: dict[str, str], base_env: dict[str, str] | None = None,
                 item_filter: str | None = None, clock: Callable[[], float] = time.monotonic,
                 timeout_scale: float = 1.0):
        """``timeout_scale``: every item's and case's time limit is multiplied by it (a smoke
        test on a shared machine gives a large one, so load never decides an item's status;
        stage budgets and the run's deadline are not scaled)."""
        self._add, self._log, self._clock = add_record, log, clock
        self._scale = timeout_scale
        self._deadline, self._workdir = deadline, workdir
        self._env = child_env(child_vars, base_env)
        self._filter = re.compile(item_filter) if item_filter else None
        self._by_key: dict[str, dict] = {}
        self._start = clock()

    def seconds_left(self) -> float:
        return self._deadline - self._clock()

    def run_stage(self, stage: str, plan: Callable[[Context], Generator], ctx: Context,
                  budget_s: float) -> None:
        stage_deadline = min(self._deadline, self._clock() + budget_s)
        self._log(f"== {stage} (budget {budget_s:.0f} s, {self.seconds_left():.0f} s left in the run)")
        try:
            steps = plan(ctx)
            sent = None
            while True:
                step = steps.send(sent)
                if isinstance(step, Summary):
                    self._record(stage, step.name, SINGLE, step.status, 0.0, result=step.result,
                                 note=step.note)
                    sent = None
                else:
                    sent = self._run_item(stage, step, stage_deadline)
        except StopIteration:
            pass
        except Exception as err:  # a bug in a stage's plan costs that stage only
            self._record(stage, "(plan)", SINGLE, "error", 0.0, error=describe(err))

    # ----------------------------------------------------------------------- one item
    def _run_item(self, stage: str, item: Item, stage_deadline: float) -> Outcome:
        if self._filter and not self._filter.search(item.name):
            self._log(f"   not selected (--items): {item.name}")  # no record: it was not asked for
            return Outcome("skipped", [])
        if item.key is not None and item.key in self._by_key:
            source = self._by_key[item.key]
            record = self._record(stage, item.name, SINGLE, "reused", 0.0, result=source["result"],
                                  note=f"same configuration as {source['stage']} / {source['item']}")
            return Outcome("reused", [record])
        if item.reuse_only:
            return self._skip(stage, item, f"{BUDGET_SKIP} (measured with the item it reuses, "
                                           "which has not run)")
        left = min(stage_deadline, self._deadline) - self._clock()
        if left < max(item.min_s, 1.0):
            return self._skip(stage, item, f"{BUDGET_SKIP} ({max(left, 0):.0f} s left, item needs "
                                           f"~{item.min_s:.0f} s)")
        records: list[dict] = []
        done: list[str] = []
        item_deadline = min(self._clock() + item.timeout_s * self._scale, self._deadline)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            outcome = run_isolated(item.target, item.kwargs, workdir=self._workdir, env=self._env,
                                   timeout_s=max(1.0, item_deadline - self._clock()),
                                   case_timeout_s=(None if item.case_timeout_s is None
                                                   else item.case_timeout_s * self._scale),
                                   skip=done)
            for case in outcome.cases:
                records.append(self._record(stage, item.name, case.case, case.status, case.seconds,
                                            result=case.result, error=case.error, detail=case.detail,
                                            attempt=attempt))
                done.append(case.case)
            if not self._retry(outcome, item_deadline):
                break
            self._log(f"   restarting {item.name!r} without the {len(done)} case(s) already recorded")
        if not outcome.finished and item_deadline - self._clock() <= 5.0 and done and SINGLE not in done:
            # The item's time ran out with cases not yet started: say so, or they would vanish.
            note = f"{BUDGET_SKIP} (the item's time ran out after {len(done)} case(s))"
            records.append(self._record(stage, item.name, "(cases not started)", "skipped", 0.0, note=note))
        failed = [r["status"] for r in records if r["status"] != "ok"]
        status = "ok" if records and not failed else (failed[0] if failed else "error")
        if status == "ok" and item.key is not None and len(records) == 1:
            self._by_key[item.key] = records[0]
        return Outcome(status, records)

    def _retry(self, outcome: ItemOutcome, item_deadline: float) -> bool:
        """Start the child again only if it died inside a case (so skipping that case makes
        progress) and there is time left."""
        if outcome.finished or not outcome.cases:
            return False
        last = outcome.cases[-1]
        died_in_case = last.status in ("crash", "timeout") and last.case not in (SINGLE, "(setup)")
        return died_in_case and item_deadline - self._clock() > 5.0

    def _skip(self, stage: str, item: Item, why: str) -> Outcome:
        return Outcome("skipped", [self._record(stage, item.name, SINGLE, "skipped", 0.0, note=why)])

    def _record(self, stage: str, item: str, case: str, status: str, seconds: float, *,
                result=None, error=None, note=None, detail=None, attempt=1) -> dict:
        record = {"stage": stage, "item": item, "case": case, "status": status,
                  "seconds": round(seconds, 3), "elapsed_s": round(self._clock() - self._start, 1),
                  "result": result, "error": error, "note": note, "attempt": attempt}
        self._add(record, detail=detail)
        return record
