"""The suite's own settings and closing report, the same with one process or with pytest-xdist's workers:

- the 15 slowest tests and modules (setup, call and teardown together: a module fixture's work counts in the
  setup of the first test that asks for it) and every test over ``LIMIT_S`` seconds, except those
  setup.cfg's ``long_tests`` lists with a reason, so the suite's growth shows in every CI log;
- the largest errors against the float64 reference (tests/numerics.py) and the largest differences of
  patched Hugging Face models from eager (tests/hf_models.py), recorded by the tests wherever they ran.

Registered by tests/conftest.py.
"""

from __future__ import annotations

import collections
import json
import os
import sys

LIMIT_S = 120.0
SLOWEST = 15
# (key, module, name): the tests' records of largest values, nested three levels deep (e.g. backend ->
# dtype -> quantity -> largest error). A worker sends its records to the controller as JSON.
RECORDS = (("errors", "numerics", "MAX_ERRORS"), ("diffs", "hf_models", "MAX_DIFFS"))


def add_options(parser):
    parser.addini("first_modules", type="linelist",
                  help="test modules (file names) to run first, longest first: with pytest-xdist's workers the "
                       "long ones start at once and the short ones fill in")
    parser.addini("long_tests", type="linelist",
                  help=f"tests that may take over {LIMIT_S:.0f} s, one per line: 'NODE_ID: reason'")


def _recorded() -> dict:
    """This process's records (only those of modules a test imported)."""
    found = {}
    for key, module, name in RECORDS:
        if module in sys.modules:
            found[key] = json.loads(json.dumps(getattr(sys.modules[module], name)))
    return found


def _merge_largest(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict):
            _merge_largest(into.setdefault(key, {}), value)
        else:
            into[key] = max(into.get(key, value), value)


class SuiteReport:
    def __init__(self, config):
        self.config = config
        self.seconds = collections.Counter()
        self.records: dict = {}

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] += report.duration

    def pytest_sessionfinish(self):
        worker = getattr(self.config, "workeroutput", None)
        if worker is not None:  # an xdist worker: the controller prints
            worker["records"] = json.dumps(_recorded())

    def pytest_testnodedown(self, node, error):
        _merge_largest(self.records, json.loads(getattr(node, "workeroutput", {}).get("records", "{}")))

    def pytest_terminal_summary(self, terminalreporter):
        _merge_largest(self.records, _recorded())
        self._times(terminalreporter)
        _family_summary(terminalreporter, self.records.get("diffs", {}))
        _error_summary(terminalreporter, self.records.get("errors", {}))

    def _times(self, terminalreporter):
        if not self.seconds:
            return
        allowed = dict(line.split(": ", 1) for line in self.config.getini("long_tests"))
        terminalreporter.section(f"{SLOWEST} slowest tests (setup + call + teardown)")
        for nodeid, seconds in self.seconds.most_common(SLOWEST):
            terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")
        modules = collections.Counter()
        for nodeid, seconds in self.seconds.items():
            modules[nodeid.split("::", 1)[0]] += seconds
        terminalreporter.write_line("slowest modules (setup.cfg's first_modules): " + ", ".join(
            f"{os.path.basename(module)} {seconds:.0f} s" for module, seconds in modules.most_common(SLOWEST)))
        over = [(nodeid, seconds) for nodeid, seconds in self.seconds.most_common() if seconds > LIMIT_S]
        terminalreporter.write_line(f"total {sum(self.seconds.values()):.0f} s of test time in "
                                    f"{len(self.seconds)} tests")
        for nodeid, seconds in over:
            reason = allowed.get(nodeid)
            verdict = (f"listed in setup.cfg: {reason}" if reason else
                       "a finding: make it faster or list it in setup.cfg's long_tests with its reason")
            terminalreporter.write_line(f"over {LIMIT_S:.0f} s: {nodeid} {seconds:.0f} s: {verdict}")


def _error_summary(terminalreporter, errors: dict):
    if not errors:
        return
    terminalreporter.section("max error vs float64 reference")
    for backend, by_dtype in sorted(errors.items()):
        for dtype, largest in sorted(by_dtype.items()):
            row = "  ".join(f"{name} {err:.2e}" for name, err in largest.items())
            terminalreporter.write_line(f"{backend:<10} {dtype:<35} {row}")


def _family_summary(terminalreporter, diffs: dict):
    if not diffs:
        return
    terminalreporter.section("max |patched - eager| per family (tests/test_patches_families.py)")
    terminalreporter.write_line("out: last hidden state at real tokens; grad: every parameter gradient (rel: over the "
                                "largest |grad|); packed(_pos): packed row vs documents alone, from cu_seq_lens "
                                "(position_ids)")
    names = ("out", "grad", "grad_rel", "packed", "packed_pos")
    terminalreporter.write_line(f"{'family':<12} {'backend':<10} " + " ".join(f"{n:>9}" for n in names))
    for family, by_backend in diffs.items():
        for backend, largest in sorted(by_backend.items()):
            cells = " ".join(f"{largest[n]:9.1e}" if n in largest else f"{'-':>9}" for n in names)
            terminalreporter.write_line(f"{family:<12} {backend:<10} {cells}")
