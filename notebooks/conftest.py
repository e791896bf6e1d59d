"""A time report for the notebooks: after `pytest --nbval`, how long each notebook's cells took in all.

The course promises that every notebook runs in about a minute on a laptop CPU (README); this prints the
measured figure for each notebook on the machine that ran the tests, slowest first. It reports and never
fails a test: timing belongs in a report, not in an assertion.
"""

from collections import defaultdict

_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        _seconds[path] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _seconds:
        return
    terminalreporter.section("notebook run times (all cells, this machine)")
    for path, seconds in sorted(_seconds.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:7.1f} s  {path}")
