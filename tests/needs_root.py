"""Tests that need root (a mount, network namespaces, packages apt-get installs) carry
`@pytest.mark.needs_root` and, without root, skip saying why. A green run's skip summary is read by no
one, so this plugin (tests/conftest.py registers it) names those skips where they cannot be missed, from
the markers rather than from a list kept by hand:

- the terminal summary has a section listing every needs_root test that skipped, with its reason;
- with NEEDS_ROOT_SKIPS=FILE in the environment (.ci/run sets it), the same lines go to FILE,
  `nodeid: reason` each, for .ci/run to print as warnings after the run;
- a skip whose reason mentions root, in a test without the marker, fails instead: that test would be
  missing from both lists.

The lists are kept where the reports arrive, in pytest's own process: under pytest-xdist (make test) the
workers run the tests and send their reports there.
"""

import os
import re

import pytest

MARKER = "needs_root"
ENV = "NEEDS_ROOT_SKIPS"
_MENTIONS_ROOT = re.compile(r"\broot\b", re.IGNORECASE)
_FILE = pytest.StashKey[str | None]()
_SKIPPED = pytest.StashKey[list[str]]()
_CONFIG = [None]  # pytest_runtest_logreport is given the report alone.


def pytest_configure(config):
  config.addinivalue_line(
    "markers",
    f"{MARKER}: needs root where the machine lacks something (a mount, network namespaces, apt-get) and "
    "skips without it; the run names each such skip (tests/needs_root.py)",
  )
  # Taken out of the environment: a pytest that a test starts writes nothing into the run's list.
  config.stash[_FILE] = os.environ.pop(ENV, None)
  config.stash[_SKIPPED] = []
  _CONFIG[0] = config


def _reason(report) -> str:
  longrepr = report.longrepr  # A skip's is (path, line, "Skipped: why").
  reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
  return reason.removeprefix("Skipped: ")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  report = yield
  if not report.skipped or hasattr(report, "wasxfail"):
    return report
  if item.get_closest_marker(MARKER) is None and _MENTIONS_ROOT.search(_reason(report)):
    report.outcome = "failed"
    report.longrepr = (
      f"{item.nodeid} skipped for want of root ({_reason(report)}) without @pytest.mark.{MARKER}: "
      "mark it, so that the run names it among the tests that need root"
    )
  return report


def pytest_runtest_logreport(report):
  """Where the reports arrive: in pytest's own process, also when xdist's workers ran the tests."""
  if report.skipped and not hasattr(report, "wasxfail") and MARKER in report.keywords:
    _CONFIG[0].stash[_SKIPPED].append(f"{report.nodeid}: {_reason(report)}")


def pytest_terminal_summary(terminalreporter, config):
  if skipped := config.stash.get(_SKIPPED, []):
    terminalreporter.section(f"needs root: {len(skipped)} skipped, untested here", yellow=True)
    for line in skipped:
      terminalreporter.line(line)


def pytest_sessionfinish(session):
  if path := session.config.stash.get(_FILE, None):
    with open(path, "w") as f:
      f.writelines(f"{line}\n" for line in session.config.stash.get(_SKIPPED, []))
