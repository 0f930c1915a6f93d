#!/usr/bin/env python3
"""Run one of Triton's own qa suites, unchanged, against tritonserver 2.51 or
Continuum, and count the outcomes per test file.

    run.py --triton-checkout /tmp/tsrv --server continuum --suite L0_backend_python/bls

What it does:
1. copies the checkout's qa/ into a scratch folder (the scripts write models
   and logs next to themselves; the checkout stays clean), seen in the run
   as /opt/tritonserver/qa like in Triton's CI image, and prepares what
   Triton's CI image would hold (suites.py `prepare`): a DATADIR with the
   generated / placeholder models, L0_decoupled's python_models, a local
   `git clone` source for python_backend;
2. lays out /opt/tritonserver/bin/tritonserver -> the chosen wrapper
   (tritonserver_wrapper or continuum_wrapper), because test.sh scripts use
   that path, and stubs pip / pip3 (everything is preinstalled);
3. runs the suite's test.sh (or slice / driver) inside a private network
   namespace (ports 8000-8002 are its own) and a private mount namespace
   (/opt and /dev/shm are private tmpfs / bind mounts);
4. reads the outcomes that qa_collect.py (installed in the client venv)
   recorded for every pytest / unittest test, and writes
   benchmarks/results/triton_qa/<suite>-<server>.json.
Only the processes started inside the namespace are killed afterwards.
"""
import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import prepare
import suites as suite_defs

HERE = os.path.dirname(os.path.realpath(__file__))
CHECKOUT = os.path.dirname(os.path.dirname(HERE))
RESULTS_DIR = os.path.join(CHECKOUT, "benchmarks", "results", "triton_qa")
WRAPPERS = {"triton": "tritonserver_wrapper", "continuum": "continuum_wrapper"}
CLIENT_PACKAGES = ["tritonclient[all]==2.51.0", "sseclient-py", "requests", "pytest",
                   "numpy<2", "onnx", "psutil"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--triton-checkout", required=True, help="server repo checkout (has qa/)")
    p.add_argument("--server", required=True, choices=sorted(WRAPPERS))
    p.add_argument("--suite", required=True, choices=sorted(suite_defs.SUITES))
    p.add_argument("--tag", default="", help="suffix of the result name, e.g. main")
    p.add_argument("--client-venv", default="/tmp/qa_client_venv")
    p.add_argument("--setup-client-venv", action="store_true",
                   help="create the client venv and pip install " + " ".join(CLIENT_PACKAGES))
    p.add_argument("--work", default="/tmp/triton_qa_work", help="scratch folder")
    p.add_argument("--python-backend-git",
                   default="/work/.mirror/triton-inference-server+python_backend/repo")
    p.add_argument("--python-backend-tag", default="r24.10")
    p.add_argument("--client-git", default="/work/.mirror/triton-inference-server+client/repo",
                   help="Triton's client repo (bare git), for qa/clients' python examples")
    p.add_argument("--client-tag", default="r24.10")
    p.add_argument("--timeout", type=int, help="suite timeout in s (default: the suite's)")
    p.add_argument("--test-timeout", type=int, default=180,
                   help="one test longer than this is ended and counted as hung")
    p.add_argument("--continuum-checkout", default="",
                   help="Continuum tree to serve (default: the one run.py is in)")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="extra environment for the script (repeatable)")
    return p.parse_args()


# ---- client venv ----------------------------------------------------------

def client_site(venv):
    py = os.path.join(venv, "bin", "python")
    out = subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    return out.decode().strip()


def build_shm_monitor(venv, site, args):
    """qa/common/shm_util.py imports triton_shm_monitor, a pybind11 module of
    python_backend (src/shm_monitor) that Triton's CI image builds; build it the
    same way (needs g++, libboost-dev, pybind11) into the client venv."""
    py = os.path.join(venv, "bin", "python")
    subprocess.check_call([os.path.join(venv, "bin", "pip"), "install", "-q", "pybind11"])
    src = os.path.join(args.work, "python_backend_src")
    os.makedirs(src, exist_ok=True)
    archive = subprocess.check_output(["git", f"--git-dir={args.python_backend_git}", "archive",
                                       args.python_backend_tag, "src"])
    subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    paths = json.loads(subprocess.check_output([py, "-c", (
        "import json, sysconfig, pybind11; print(json.dumps([sysconfig.get_paths()['include'],"
        " pybind11.get_include(), sysconfig.get_config_var('EXT_SUFFIX')]))")]))
    subprocess.check_call(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", f"-I{paths[0]}",
                           f"-I{paths[1]}", f"{src}/src/shm_monitor/shm_monitor.cc",
                           f"{src}/src/shm_manager.cc", "-o",
                           os.path.join(site, "triton_shm_monitor" + paths[2]), "-lrt"])


def setup_client_venv(venv, create, args):
    if create and not os.path.exists(os.path.join(venv, "bin", "python")):
        subprocess.check_call([sys.executable, "-m", "venv", venv])
    if create:
        subprocess.check_call([os.path.join(venv, "bin", "pip"), "install", "-q"] + CLIENT_PACKAGES)
    site = client_site(venv)
    if create:
        build_shm_monitor(venv, site, args)
    shutil.copy(os.path.join(HERE, "qa_collect.py"), site)
    with open(os.path.join(site, "qa_collect_boot.pth"), "w") as f:
        f.write("import qa_collect; qa_collect.boot()\n")


# ---- scratch folder -------------------------------------------------------

def fresh_work(args, suite):
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{suite.name}-{args.server}{args.tag and '-' + args.tag}")
    # one folder per run (pid): runs of the same suite by others are left alone
    work = os.path.join(args.work, f"{name}.{os.getpid()}")
    # Triton's CI image runs the scripts from /opt/tritonserver/qa (the init_args
    # model checks that path); work/qa points there.
    shutil.copytree(os.path.join(args.triton_checkout, "qa"),
                    os.path.join(work, "opt/tritonserver/qa"), symlinks=True)
    os.symlink("opt/tritonserver/qa", os.path.join(work, "qa"))
    for sub in ("tmp", "data", "org", "shims", "opt/tritonserver/bin", "opt/tritonserver/backends"):
        os.makedirs(os.path.join(work, sub), exist_ok=True)
    os.symlink(os.path.join(HERE, WRAPPERS[args.server]),
               os.path.join(work, "opt/tritonserver/bin/tritonserver"))
    os.symlink(args.python_backend_git, os.path.join(work, "org", "python_backend"))
    write_shims(os.path.join(work, "shims"))
    return work


def write_shims(shims):
    """pip: everything is preinstalled; gdb: util.sh's hang helper would gcore the server."""
    for name in ("pip", "pip3", "gdb"):
        path = os.path.join(shims, name)
        with open(path, "w") as f:
            f.write('#!/bin/sh\necho "[triton_qa shim] skipped: %s $*"\nexit 0\n' % name)
        os.chmod(path, 0o755)


# ---- the script ------------------------------------------------------------

def script_to_run(work, suite):
    """(script path relative to the suite folder, edits applied)."""
    folder = os.path.join(work, "qa", suite.qa_dir)
    if suite.driver is not None:
        with open(os.path.join(folder, "qa_driver.sh"), "w") as f:
            f.write("source ../common/util.sh\n" + suite.driver)
        return "qa_driver.sh", ["driver: " + " ".join(suite.driver.split())[:200]]
    if not suite.edits and not suite.cut_at:
        return suite.script, []
    with open(os.path.join(folder, suite.script)) as f:
        text = f.read()
    return write_slice(folder, suite, text)


def write_slice(folder, suite, text):
    applied = []
    for pattern, repl in suite.edits:
        text, n = re.subn(pattern, repl, text, flags=re.M)
        if not n:
            sys.exit(f"{suite.script}: edit pattern {pattern!r} not found (other Triton version?)")
        applied.append(f"{n} x s/{pattern}/{repl}/")
    if suite.cut_at:
        m = re.search(suite.cut_at, text, flags=re.M)
        if not m:
            sys.exit(f"{suite.script}: cut marker {suite.cut_at!r} not found")
        text = text[:m.start()] + 'echo "*** qa slice ends here, RET=$RET"\nexit $RET\n'
        applied.append(f"cut from the line matching {suite.cut_at!r} to the end")
    with open(os.path.join(folder, "test.qa_slice.sh"), "w") as f:
        f.write(text)
    return "test.qa_slice.sh", applied


def script_env(work, args, suite):
    env = {
        "PATH": f"{work}/shims:{args.client_venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:"
                "/usr/bin:/sbin:/bin:/opt/tritonserver/bin",  # log_format_test.py runs `tritonserver`
        "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
        "SERVER": "/opt/tritonserver/bin/tritonserver", "TRITON_DIR": "/opt/tritonserver",
        "BACKEND_DIR": "/opt/tritonserver/backends", "DATADIR": f"{work}/data",
        "TRITON_REPO_ORGANIZATION": f"file://{work}/org",
        "PYTHON_BACKEND_REPO_TAG": args.python_backend_tag,
        "NVIDIA_TRITON_SERVER_VERSION": "24.10", "TEST_WINDOWS": "0", "TEST_JETSON": "0",
        "QA_PYTHON_ONLY": "1", "QA_TMP": f"{work}/tmp", "QA_RESULTS_FILE": f"{work}/results.jsonl",
        "QA_TEST_TIMEOUT": str(args.test_timeout), "PYTEST_PLUGINS": "qa_collect",
        "TRITON_VENV": os.environ.get("TRITON_VENV", "/tmp/tv"),
    }
    if "CONTINUUM_PYTHON" in os.environ:
        env["CONTINUUM_PYTHON"] = os.environ["CONTINUUM_PYTHON"]
    if args.continuum_checkout:
        env["CONTINUUM_CHECKOUT"] = os.path.abspath(args.continuum_checkout)
    for key, value in suite.env.items():
        env[key] = value.format(qa="/opt/tritonserver/qa")
    for item in args.env:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def namespace_driver(work, suite, script, timeout):
    """bash run inside the namespaces: private /dev/shm and /opt, then the script."""
    path = os.path.join(work, "ns_driver.sh")
    with open(os.path.join(work, "ps4.sh"), "w") as f:  # bash -x lines carry the line number
        f.write("PS4='+ ${LINENO}: '\n")             # (root's bash ignores PS4 from env)
    with open(path, "w") as f:
        f.write(f"""set -u
export BASH_ENV={work}/ps4.sh
mount -t tmpfs -o size=1g triton_qa_shm /dev/shm
mount --bind {work}/opt /opt
ip link set lo up
cd /opt/tritonserver/qa/{suite.qa_dir}
timeout -k 30 {timeout} bash {suite.bash} {script} {' '.join(suite.args)}
echo "triton_qa: script exit code $?"
""")
    return path


def run_in_namespace(work, driver, env, timeout):
    """Run driver in a new netns + mount ns; return (rc, timed_out, seconds)."""
    ns = f"triton_qa_{os.getpid()}"
    subprocess.check_call(["ip", "netns", "add", ns])
    start = time.time()
    timed_out = False
    log = open(os.path.join(work, "script.log"), "w")
    try:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "-m", "--propagation",
                                 "private", "bash", driver], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout + 90)
        except subprocess.TimeoutExpired:
            timed_out, rc = True, None
    finally:
        kill_namespace_processes(ns)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait()
        subprocess.call(["ip", "netns", "del", ns])
        log.close()
    return rc, timed_out, time.time() - start


def kill_namespace_processes(ns):
    """SIGKILL, one id at a time, what still runs in our own namespace."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in out.split():
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass


# ---- results ---------------------------------------------------------------

def read_records(work):
    path = os.path.join(work, "results.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def outcomes(records):
    """[(record, outcome)], 'hung' for a start that got no result in its process."""
    done = collections.Counter((r["pid"], r["test"]) for r in records if r["event"] == "result")
    out = []
    for r in records:
        if r["event"] == "result":
            out.append((r, r["outcome"]))
        elif done[(r["pid"], r["test"])] > 0:
            done[(r["pid"], r["test"])] -= 1
        else:
            out.append((r, "hung"))
    return out


def count(results):
    per_file = collections.defaultdict(collections.Counter)
    for rec, outcome in results:
        per_file[os.path.basename(rec["file"])][outcome] += 1
    keys = ("passed", "failed", "error", "skipped", "hung")
    files = {f: {k: c.get(k, 0) for k in keys} for f, c in sorted(per_file.items())}
    totals = {k: sum(f[k] for f in files.values()) for k in keys}
    return files, totals


def problems(results):
    return [{"test": rec["test"], "outcome": outcome, "context": rec.get("context", {}),
             "message": rec.get("message", "")}
            for rec, outcome in results if outcome in ("failed", "error", "hung")]


def script_messages(work):
    """test.sh's own '***' failure lines and the wrappers' notes."""
    with open(os.path.join(work, "script.log"), errors="replace") as f:
        lines = f.read().splitlines()
    keep = re.compile(r"(\*\*\* .*(fail|FAIL|Fail|not |Not |Expect|Timeout|unexpected))|"
                      r"SHUTDOWN HANG|=== Timeout|Server not running|triton_qa: script exit")
    seen, out = set(), []
    for line in lines:
        line = line.strip()
        if keep.search(line) and not line.startswith("+") and line not in seen:
            seen.add(line)
            out.append(line[:300])
    return out


def script_check_failures(work):
    """Line numbers of the script where `RET=1` ran (its own checks failing), in order."""
    with open(os.path.join(work, "script.log"), errors="replace") as f:
        return [int(n) for n in re.findall(r"^\++ (\d+): RET=1$", f.read(), flags=re.M)]


def server_log_markers(work, suite):
    out = []
    for folder, _, files in os.walk(os.path.join(work, "qa", suite.qa_dir)):
        for name in files:
            if name.endswith(".log"):
                with open(os.path.join(folder, name), errors="replace") as f:
                    if "SHUTDOWN HANG" in f.read():
                        out.append(f"{name}: SHUTDOWN HANG")
    return out


def checkout_ref(checkout, marker_name=".triton_ref"):
    """The ref a checkout was made from: its marker file, else `git describe`."""
    if not checkout:
        return ""
    marker = os.path.join(checkout, marker_name)
    if os.path.exists(marker):
        with open(marker) as f:
            return f.read().strip()
    out = subprocess.run(["git", "-C", checkout, "describe", "--always", "--dirty"],
                         capture_output=True, text=True)
    return out.stdout.strip()


def continuum_info(args):
    if args.server != "continuum":
        return None
    tree = os.path.abspath(args.continuum_checkout) if args.continuum_checkout else CHECKOUT
    return {"tree": tree, "ref": checkout_ref(tree, ".continuum_ref")}


def write_result(args, suite, work, run_info):
    results = outcomes(read_records(work))
    files, totals = count(results)
    report = {
        "suite": suite.name, "server": args.server, "tag": args.tag,
        "triton_checkout": args.triton_checkout,
        "triton_ref": checkout_ref(args.triton_checkout), "command": " ".join(sys.argv),
        "continuum": continuum_info(args),
        **run_info, "files": files, "totals": totals, "problems": problems(results),
        "script_messages": script_messages(work),
        "script_check_failures": script_check_failures(work),
        "server_log_markers": server_log_markers(work, suite), "notes": suite.notes,
        "work_dir": work,
    }
    os.makedirs(RESULTS_DIR, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", suite.name) + f"-{args.server}"
    name += f"-{args.tag}" if args.tag else ""
    path = os.path.join(RESULTS_DIR, name + ".json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    return path, report


def print_summary(path, report):
    print(f"{report['suite']} on {report['server']}: rc={report['script_rc']} "
          f"timed_out={report['timed_out']} {report['duration_s']}s")
    for name, c in report["files"].items():
        print(f"  {name:45s} " + " ".join(f"{k}={v}" for k, v in c.items()))
    print("  TOTAL " + " ".join(f"{k}={v}" for k, v in report["totals"].items()))
    for p in report["problems"]:
        print(f"  {p['outcome']:6s} {p['test']} {p['context'] or ''} :: {p['message'][:200]}")
    print(f"written {path}")


def on_sigterm(_signum, _frame):
    raise KeyboardInterrupt("SIGTERM")  # runs run_in_namespace's cleanup


def main():
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = parse_args()
    args.triton_checkout = os.path.abspath(args.triton_checkout)
    suite = suite_defs.SUITES[args.suite]
    setup_client_venv(args.client_venv, args.setup_client_venv, args)
    work = fresh_work(args, suite)
    for step in suite.prepare:
        getattr(prepare, f"prepare_{step}")(work, args, suite)
    script, edits = script_to_run(work, suite)
    timeout = args.timeout or suite.timeout
    driver = namespace_driver(work, suite, script, timeout)
    rc, timed_out, seconds = run_in_namespace(work, driver, script_env(work, args, suite), timeout)
    rc = script_exit_code(work, rc)
    info = {"script": f"qa/{suite.qa_dir}/{script} {' '.join(suite.args)}".strip(),
            "script_edits": edits, "script_rc": rc, "timed_out": timed_out or rc == 124,
            "duration_s": round(seconds)}
    path, report = write_result(args, suite, work, info)
    print_summary(path, report)


def script_exit_code(work, rc):
    with open(os.path.join(work, "script.log"), errors="replace") as f:
        m = re.findall(r"triton_qa: script exit code (\d+)", f.read())
    return int(m[-1]) if m else rc


if __name__ == "__main__":
    main()
