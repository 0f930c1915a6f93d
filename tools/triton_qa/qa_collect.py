"""Records every test outcome of Triton's qa client tests, whichever way
test.sh runs them (pytest, or `python x_test.py [Class.test]` = unittest).

run.py copies this module into the client venv's site-packages with a .pth
line that calls `boot()`; it does nothing unless QA_RESULTS_FILE is set.
Then:
- unittest: TestResult's add* methods are wrapped, so each outcome is
  appended as one JSON line to QA_RESULTS_FILE;
- pytest: PYTEST_PLUGINS=qa_collect loads this module as a plugin
  (pytest_runtest_logreport / pytest_collectreport).
Each test start is written too ("start"), so a test that never finished
(killed) shows as a start without an outcome, which run.py counts as "hung".
QA_TEST_TIMEOUT (s): a test running longer gets a TestTimeout exception
(SIGALRM) and is recorded as "hung"; the file's next tests still run.
"""
import faulthandler
import json
import os
import signal
import sys
import time

UNDER_PYTEST = False
# Environment that test.sh varies between runs of one test file.
CONTEXT_VARS = ("MODEL_NAME", "BLS_KIND", "TRIAL", "NO_BATCHING", "MODEL_INSTANCES",
                "BATCHER_TYPE", "TRITONSERVER_DELAY_SCHEDULER", "TRITONSERVER_DELAY_GRPC_RESPONSE")


def _write(record):
    path = os.environ.get("QA_RESULTS_FILE")
    if not path:
        return
    record.update(pid=os.getpid(), time=round(time.time(), 3),
                  script=os.path.basename(sys.argv[0]) if sys.argv else "",
                  cwd=os.path.basename(os.getcwd()),
                  context={k: os.environ[k] for k in CONTEXT_VARS if k in os.environ})
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class TestTimeout(BaseException):
    """Raised in a test that ran past QA_TEST_TIMEOUT (a BaseException, so that
    `except Exception` in the test does not swallow it)."""


HUNG_MARK = "QA_TEST_TIMEOUT exceeded"


def _where(frame):
    """'inner file:line in f; test file:line in g' of the interrupted stack."""
    spots, inner = [], frame
    while frame is not None:
        path = frame.f_code.co_filename
        name = os.path.basename(path)
        library = path.startswith((sys.prefix, sys.base_prefix)) or "site-packages" in path
        if "test" in name and not library:
            spots.append(f"{name}:{frame.f_lineno} in {frame.f_code.co_name}")
            break
        frame = frame.f_back
    code = inner.f_code
    return "; ".join([f"{os.path.basename(code.co_filename)}:{inner.f_lineno} in {code.co_name}"] + spots)


_hung = []  # where each timeout alarm found this process
_first_alarm = [0]  # index in _hung of the running test's first alarm


def _on_alarm(_signum, frame):
    """Fail the test; again every 20 s while its clean-up (e.g. joining a
    stream thread that waits for the server) still blocks."""
    _hung.append(_where(frame))
    signal.alarm(20)
    raise TestTimeout(f"{HUNG_MARK}: the test did not finish in "
                      f"{os.environ.get('QA_TEST_TIMEOUT')} s, waiting at {_hung[_first_alarm[0]]}")


def _exit_if_hung(status):
    """A hung test can leave non-daemon client threads that block interpreter
    exit: leave at once (outcomes are already written)."""
    if _hung:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status or 1)


def _arm():
    """SIGALRM fails the test after QA_TEST_TIMEOUT s (the next test still runs);
    if even that cannot interrupt it, faulthandler ends the process 90 s later."""
    timeout = int(float(os.environ.get("QA_TEST_TIMEOUT", "0") or 0))
    _first_alarm[0] = len(_hung)
    if timeout <= 0:
        return
    try:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(timeout)
    except ValueError:  # not the main thread
        pass
    faulthandler.dump_traceback_later(timeout + 90, exit=True)


def _disarm():
    try:
        signal.alarm(0)
    except ValueError:
        pass
    faulthandler.cancel_dump_traceback_later()


def _outcome(outcome, message):
    return "hung" if HUNG_MARK in str(message) else outcome


def _short(text, limit=500):
    """The exception part of a traceback (after its last 'File ...' frame)."""
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    frames = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("File ")]
    if frames:
        where = lines[frames[-1]].strip().split(",")
        lines = [",".join(where[1:3]).strip()] + lines[frames[-1] + 2:]
    return " | ".join(ln.strip() for ln in lines)[:limit]


def _pytest_write(nodeid, outcome, message=""):
    _write({"runner": "pytest", "event": "result", "file": nodeid.split("::")[0],
            "test": nodeid, "outcome": _outcome(outcome, message),
            "message": str(message)[:_LIMIT]})


_LIMIT = 600


# ---- unittest -------------------------------------------------------------

def _unittest_record(test, outcome, detail=""):
    if UNDER_PYTEST:
        return
    _write({"runner": "unittest", "event": "result", "file": _unittest_file(),
            "test": test.id(), "outcome": _outcome(outcome, detail), "message": _short(detail)})


def _unittest_file():
    return os.path.basename(sys.argv[0]) if sys.argv else "?"


def _wrap(cls, name, outcome, detail_arg=None):
    original = getattr(cls, name)

    def wrapper(self, test, *args):
        detail = ""
        if detail_arg is not None and len(args) > detail_arg and args[detail_arg] is not None:
            err = args[detail_arg]
            detail = self._exc_info_to_string(err, test) if isinstance(err, tuple) else err
        if name != "addSubTest" or (len(args) > 1 and args[1] is not None):
            _disarm()
            _unittest_record(test if name != "addSubTest" else args[0], outcome, detail)
        return original(self, test, *args)

    setattr(cls, name, wrapper)


def _patch_unittest():
    import unittest

    cls = unittest.TestResult
    original_start = cls.startTest

    def start(self, test):
        if not UNDER_PYTEST:
            _write({"runner": "unittest", "event": "start", "file": _unittest_file(),
                    "test": test.id()})
            _arm()
        return original_start(self, test)

    cls.startTest = start
    original_stop_run = cls.stopTestRun

    def stop_run(self):
        original_stop_run(self)
        if not UNDER_PYTEST:
            _exit_if_hung(1)

    cls.stopTestRun = stop_run
    _wrap(cls, "addSuccess", "passed")
    _wrap(cls, "addFailure", "failed", 0)
    _wrap(cls, "addError", "error", 0)
    _wrap(cls, "addSkip", "skipped", 0)
    _wrap(cls, "addExpectedFailure", "passed")
    _wrap(cls, "addUnexpectedSuccess", "failed")
    _wrap(cls, "addSubTest", "failed", 1)


def boot():
    """Called by the .pth line (once per site dir: a venv's lib64 -> lib makes two)."""
    import unittest
    if os.environ.get("QA_RESULTS_FILE") and not getattr(unittest.TestResult, "_qa_collect", False):
        _patch_unittest()
        unittest.TestResult._qa_collect = True


# ---- pytest plugin --------------------------------------------------------

def pytest_configure(config):
    global UNDER_PYTEST
    UNDER_PYTEST = True


def pytest_unconfigure(config):
    _exit_if_hung(getattr(config, "_qa_exitstatus", 1))


def pytest_sessionfinish(session, exitstatus):
    session.config._qa_exitstatus = int(exitstatus)


def pytest_runtest_logstart(nodeid, location):
    _write({"runner": "pytest", "event": "start", "file": nodeid.split("::")[0],
            "test": nodeid})
    _arm()


def _pytest_message(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return f"{os.path.basename(crash.path)}:{crash.lineno}: {crash.message}"
    if isinstance(report.longrepr, tuple):  # skip: (path, line, reason)
        return str(report.longrepr[-1])
    return report.longreprtext


def pytest_runtest_logreport(report):
    message = _pytest_message(report) if report.outcome != "passed" else ""
    if report.when == "setup" and report.outcome != "passed":
        _pytest_write(report.nodeid, "error" if report.failed else "skipped", message)
    elif report.when == "call":
        _pytest_write(report.nodeid, report.outcome, message)
    elif report.when == "teardown":
        _disarm()
        if report.failed:
            _pytest_write(report.nodeid, "error", message)


def pytest_collectreport(report):
    if report.failed:
        _pytest_write(report.nodeid or "?", "error", "collection: " + report.longreprtext)
