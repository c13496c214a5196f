"""Progress by file: one line as each test file finishes (its tests' outcomes and time, how many
files are done, the time since the start), in place of a letter per test. A failure or error also
gets its own line at once, so nobody waits for its file to end to see it; pytest's summary at
the end still lists every one. Works with and without pytest-xdist's workers."""
from __future__ import annotations

import time
from collections import Counter, defaultdict

import pytest


def _file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


class FileProgress:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.expected: Counter = Counter()  # file -> how many tests it has
        self.finished: Counter = Counter()
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.seconds: Counter = Counter()
        self.worst: dict[str, str] = {}  # a running test's outcome so far
        self.files_done = 0
        self.start = time.monotonic()

    def _expect(self, nodeids) -> None:
        if not self.expected:  # every worker collects the same tests: count them once
            self.expected.update(_file_of(n) for n in nodeids)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        self._expect(ids)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._expect(item.nodeid for item in session.items)

    def pytest_report_teststatus(self, report):
        # No letter for any outcome: letters written without a newline glue themselves to the
        # start of the next file's line.
        if hasattr(report, "wasxfail"):
            return ("xfailed", "", "XFAIL") if report.skipped else ("xpassed", "", "XPASS")
        if report.passed and report.when == "call":
            return "passed", "", "PASSED"
        if report.skipped:
            return "skipped", "", "SKIPPED"
        if report.failed:
            return ("failed", "", "FAILED") if report.when == "call" else ("error", "", "ERROR")
        return None

    def pytest_runtest_logreport(self, report) -> None:
        file = _file_of(report.nodeid)
        self.seconds[file] += report.duration
        so_far = self.worst.get(report.nodeid, "passed")
        if report.failed:
            self.worst[report.nodeid] = "failed"
            what = "FAILED" if report.when == "call" else f"ERROR in {report.when}"
            self._write(f"{what} {report.nodeid}")
        elif report.skipped and so_far == "passed":
            self.worst[report.nodeid] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
        if report.when != "teardown":
            return
        self.outcomes[file][self.worst.pop(report.nodeid, "passed")] += 1
        self.finished[file] += 1
        if self.finished[file] == self.expected.get(file):
            self.files_done += 1
            self._line(file)

    def _line(self, file: str) -> None:
        counts = ", ".join(f"{n} {what}" for what, n in sorted(self.outcomes[file].items()))
        elapsed = time.monotonic() - self.start
        self._write(
            f"{file}: {counts} ({self.seconds[file]:.0f} s) "
            f"[{self.files_done}/{len(self.expected)} files, "
            f"{sum(self.finished.values())}/{sum(self.expected.values())} tests, "
            f"{elapsed / 60:.1f} min]"
        )

    def _write(self, line: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(line)

