"""The code sandbox: limits end bad code as the right kind of error, and nothing is left behind."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from _helpers import sandbox_package

from treerl.envs.sandbox import (
    SandboxErrorKind,
    SandboxLimits,
    SandboxResult,
    arun_python,
    classify_outcome,
    max_concurrent_runs,
    run_python,
    sandbox_capabilities,
    set_max_concurrent_runs,
)

FAST = SandboxLimits(timeout_s=2.0)


def _live_processes_of(result: SandboxResult) -> list[str]:
    """Non-zombie processes still in the run's session/group or running as its private uid."""
    left = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            owner = os.stat(f"/proc/{name}").st_uid
        except (OSError, IndexError):
            continue
        if fields[0] == b"Z":
            continue
        if int(fields[2]) == result.pid or int(fields[3]) == result.pid or (result.uid is not None and owner == result.uid):
            left.append(name)
    return left


def _assert_clean(result: SandboxResult) -> None:
    assert result.pid is not None
    assert _live_processes_of(result) == []


@pytest.fixture
def listener():
    """A real TCP listener on loopback: if the sandbox leaked, the connection would succeed."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    yield srv
    srv.close()


def _accepted_any(srv: socket.socket) -> bool:
    try:
        conn, _ = srv.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


# --- normal operation ------------------------------------------------------------------


def test_prints_and_succeeds():
    result = run_python("import math\nprint('hello', math.factorial(5))", limits=FAST)
    assert result.ok, result.stderr
    assert result.stdout == "hello 120\n"
    assert result.exit_code == 0 and result.error is None
    assert 0 < result.duration_s < FAST.timeout_s
    _assert_clean(result)


def test_stdin_is_passed():
    result = run_python("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin="1 2 3\n4\n", limits=FAST)
    assert result.ok, result.stderr
    assert result.stdout == "10\n"


def test_no_stdin_reads_eof():
    result = run_python("import sys\nprint(repr(sys.stdin.read()))", limits=FAST)
    assert result.stdout == "''\n"


def test_runs_as_main_with_unicode():
    result = run_python("if __name__ == '__main__':\n    print('héllo ✓')", limits=FAST)
    assert result.ok, result.stderr
    assert result.stdout == "héllo ✓\n"


def test_a_caller_reading_stdout_as_it_arrives_can_stop_the_run():
    seen = []

    def on_stdout(data):
        seen.append(data)
        return b"stop" in b"".join(seen)

    start = time.monotonic()
    code = "import sys, time\nprint('stop', flush=True)\ntime.sleep(30)\nprint('never')"
    result = run_python(code, limits=SandboxLimits(timeout_s=30.0), on_stdout=on_stdout)
    assert time.monotonic() - start < 5.0
    assert result.stopped and result.error is None and result.exit_code is None
    assert b"".join(seen) == b"stop\n"
    assert result.stdout == ""  # handed to the caller, not kept twice
    assert run_python("print(1)", on_stdout=lambda data: False).ok  # never asked: an ordinary run


def test_stdout_handed_to_the_caller_still_counts_against_the_limit():
    seen = []
    result = run_python("print('x' * 10_000)", limits=SandboxLimits(max_output_bytes=100),
                        on_stdout=lambda data: seen.append(data) and False)
    assert b"".join(seen) == b"x" * 100 and result.stdout == "" and result.stdout_truncated


def test_output_is_truncated_and_flagged():
    limits = SandboxLimits(timeout_s=5.0, max_output_bytes=100)
    result = run_python("import sys\nprint('x' * 10_000)\nprint('e' * 500, file=sys.stderr)", limits=limits)
    assert result.ok, result.stderr
    assert result.stdout == "x" * 100
    assert result.stderr == "e" * 100
    assert result.truncated and result.stdout_truncated
    assert not run_python("print('short')", limits=limits).truncated
    noisy = run_python("import sys\nprint('ok')\nprint('e' * 500, file=sys.stderr)", limits=limits)
    assert noisy.truncated and not noisy.stdout_truncated  # only stderr was cut


def test_endless_output_is_cut_and_timed_out():
    limits = SandboxLimits(timeout_s=1.0, max_output_bytes=1000)
    result = run_python("while True:\n    print('y' * 1000)", limits=limits)
    assert result.error is SandboxErrorKind.TIMEOUT
    assert len(result.stdout) == 1000 and result.truncated
    _assert_clean(result)


def test_private_working_directory_is_removed():
    code = "import os\nprint(os.getcwd())\nopen('scratch.txt', 'w').write('x')\nprint(sorted(os.listdir('.')))"
    first = run_python(code, limits=FAST)
    second = run_python(code, limits=FAST)
    assert first.ok and second.ok, first.stderr + second.stderr
    cwd1, listing1 = first.stdout.splitlines()
    cwd2, _ = second.stdout.splitlines()
    assert listing1 == "['scratch.txt']"  # it started empty
    assert cwd1 != cwd2 and cwd1 != os.getcwd()
    assert not os.path.exists(cwd1) and not os.path.exists(cwd2)


def test_files_are_written_into_the_working_directory():
    code = (
        "import os\n"
        "print(open('data/input.txt').read())\n"
        "print(open('notes.md').read())\n"
        "open('data/output.txt', 'w').write('done')\n"
        "print(sorted(os.listdir('data')))\n"
    )
    result = run_python(code, files={"data/input.txt": "in-data", "notes.md": "# notes"}, limits=FAST)
    assert result.ok, result.stderr
    assert result.stdout.splitlines() == ["in-data", "# notes", "['input.txt', 'output.txt']"]


@pytest.mark.parametrize("bad", ["/etc/passwd", "../escape.txt", "a/../../b"])
def test_files_outside_the_working_directory_are_refused(bad):
    with pytest.raises(ValueError, match="relative path"):
        run_python("pass", files={bad: "x"})


def test_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("TREERL_TEST_SECRET_TOKEN", "hunter2")
    result = run_python("import os\nprint(sorted(os.environ))", limits=FAST)
    assert result.ok, result.stderr
    assert "TREERL_TEST_SECRET_TOKEN" not in result.stdout
    assert "hunter2" not in result.stdout


def test_isolated_mode_ignores_python_variables(monkeypatch):
    monkeypatch.setenv("PYTHONSTARTUP", "/nonexistent")
    result = run_python("import sys\nprint(sys.flags.isolated)", limits=FAST)
    assert result.stdout == "1\n"


def test_the_bootstrap_is_a_module_file_run_by_path():
    """No program travels in a string: the child's command line names the bootstrap's file."""
    import treerl.envs.sandbox_bootstrap

    code = "import json\nprint(json.dumps(open('/proc/self/cmdline', 'rb').read().decode().split('\\0')[:-1]))"
    result = run_python(code, limits=FAST)
    assert result.ok, result.stderr
    argv = json.loads(result.stdout)
    assert "-c" not in argv and "-I" in argv
    assert argv[-2] == treerl.envs.sandbox_bootstrap.__file__


def test_runtime_error_and_exit_codes():
    crashed = run_python("def f():\n    return 1 / 0\nf()", limits=FAST)
    assert crashed.error is SandboxErrorKind.RUNTIME_ERROR and crashed.exit_code == 1
    assert "ZeroDivisionError" in crashed.stderr and 'File "<sandbox>", line 2, in f' in crashed.stderr
    assert "_treerl_bootstrap" not in crashed.stderr
    exited = run_python("import sys\nsys.exit(3)", limits=FAST)
    assert exited.error is SandboxErrorKind.RUNTIME_ERROR and exited.exit_code == 3
    clean_exit = run_python("import sys\nprint('bye')\nsys.exit(0)", limits=FAST)
    assert clean_exit.ok and clean_exit.stdout == "bye\n"


def test_arun_python_from_an_event_loop():
    async def main():
        return await asyncio.gather(*(arun_python(f"print({i} * 2)", limits=FAST) for i in range(3)))

    results = asyncio.run(main())
    assert [r.stdout for r in results] == ["0\n", "2\n", "4\n"]



def test_arun_python_waiting_for_a_slot_does_not_hold_the_loops_executor(monkeypatch):
    """Runs past the slot bound wait in threads of their own: the loop's default executor, which
    every asyncio.to_thread shares, stays free for the rest of the episode's work."""
    monkeypatch.setenv("TREERL_SANDBOX_MAX_CONCURRENT", "1")

    async def main():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(2))
        runs = [asyncio.ensure_future(arun_python("import time; time.sleep(0.5)", limits=FAST)) for _ in range(3)]
        await asyncio.sleep(0.2)  # one run holds the slot, two wait for it
        start = time.monotonic()
        await asyncio.to_thread(lambda: None)
        waited = time.monotonic() - start
        await asyncio.gather(*runs)
        return waited

    assert asyncio.run(main()) < 0.25


def test_concurrent_runs_from_threads_do_not_interfere():
    codes = ["import time\ntime.sleep(0.2)\nprint('slow')", "print('fast')", "while True: pass", "1/0"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda c: run_python(c, limits=SandboxLimits(timeout_s=1.5)), codes))
    assert results[0].stdout == "slow\n" and results[1].stdout == "fast\n"
    assert results[2].error is SandboxErrorKind.TIMEOUT
    assert results[3].error is SandboxErrorKind.RUNTIME_ERROR
    for r in results:
        _assert_clean(r)


def test_runs_past_the_concurrency_bound_wait_and_the_wait_is_not_timed(monkeypatch):
    # One slot: four runs of 0.4 s each go one after the other (about 2 s in all); had the
    # wait for the slot counted against the 1 s limit, the last ones would time out.
    monkeypatch.setenv("TREERL_SANDBOX_MAX_CONCURRENT", "1")
    code = "import time\nstart = time.time()\ntime.sleep(0.4)\nprint(start, time.time())"
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: run_python(code, limits=SandboxLimits(timeout_s=1.0)), range(4)))
    assert [r.error for r in results] == [None] * 4, [r.stderr for r in results]
    spans = sorted(tuple(map(float, r.stdout.split())) for r in results)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), spans  # never two at once
    assert max(r.wait_s for r in results) > 0.8  # the last one waited for about three runs
    assert all(r.duration_s < 1.0 for r in results)


def test_the_concurrency_bound_is_configurable(monkeypatch):
    monkeypatch.delenv("TREERL_SANDBOX_MAX_CONCURRENT", raising=False)
    default = max_concurrent_runs()
    assert default == len(os.sched_getaffinity(0))
    try:
        set_max_concurrent_runs(3)
        assert max_concurrent_runs() == 3
    finally:
        set_max_concurrent_runs(None)
    assert max_concurrent_runs() == default
    with pytest.raises(ValueError, match="integer >= 1"):
        set_max_concurrent_runs(0)
    monkeypatch.setenv("TREERL_SANDBOX_MAX_CONCURRENT", "many")
    with pytest.raises(ValueError, match="TREERL_SANDBOX_MAX_CONCURRENT"):
        max_concurrent_runs()



def test_a_forked_child_keeps_the_bound_set_in_its_parent():
    """A multiprocessing pool (fork) of rollouts: each worker starts with no slot taken, but with the
    bound its parent set, not the default, which would let every worker run one program per CPU."""
    bound = max_concurrent_runs() + 1  # not the default, whatever the CPUs
    try:
        set_max_concurrent_runs(bound)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report its bound, then leave without running the parent's cleanup
            os.write(write, str(max_concurrent_runs()).encode())
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read) as f:
            assert f.read() == str(bound)
    finally:
        set_max_concurrent_runs(None)


# --- the limits ------------------------------------------------------------------------


def test_infinite_loop_times_out_within_the_limit():
    limits = SandboxLimits(timeout_s=1.0)
    start = time.monotonic()
    result = run_python("while True:\n    pass", limits=limits)
    elapsed = time.monotonic() - start
    assert result.error is SandboxErrorKind.TIMEOUT
    assert result.exit_code is None and not result.ok
    assert 1.0 <= elapsed < 3.0
    _assert_clean(result)


def test_sleeping_code_times_out():
    result = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", limits=SandboxLimits(timeout_s=1.0))
    assert result.error is SandboxErrorKind.TIMEOUT
    assert result.stdout == "started\n"  # output before the kill is kept
    assert result.duration_s < 3.0


def test_four_gigabyte_allocation_is_a_memory_error():
    result = run_python("x = bytearray(4 * 1024 ** 3)\nprint('allocated')", limits=SandboxLimits(timeout_s=5.0, memory_mb=256))
    assert result.error is SandboxErrorKind.MEMORY
    assert "allocated" not in result.stdout and "MemoryError" in result.stderr
    assert result.duration_s < 3.0
    _assert_clean(result)


def test_gradual_allocation_is_a_memory_error():
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 ** 2))"
    result = run_python(code, limits=SandboxLimits(timeout_s=5.0, memory_mb=256))
    assert result.error is SandboxErrorKind.MEMORY
    _assert_clean(result)


def test_fork_bomb_ends_quickly_as_process_limit():
    limits = SandboxLimits(timeout_s=10.0, max_processes=8)
    result = run_python("import os\nwhile True:\n    os.fork()", limits=limits)
    assert result.error is SandboxErrorKind.PROCESS_LIMIT
    assert result.duration_s < 5.0  # well before the wall clock
    _assert_clean(result)


def test_fork_bomb_that_swallows_errors_is_stopped():
    limits = SandboxLimits(timeout_s=10.0, max_processes=8)
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run_python(code, limits=limits)
    assert result.error is SandboxErrorKind.PROCESS_LIMIT
    assert result.duration_s < 5.0
    _assert_clean(result)


def test_subprocess_bomb_is_a_process_limit():
    code = (
        "import subprocess, sys\n"
        "procs = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']) for _ in range(50)]\n"
    )
    result = run_python(code, limits=SandboxLimits(timeout_s=10.0, max_processes=4))
    assert result.error is SandboxErrorKind.PROCESS_LIMIT
    _assert_clean(result)


def test_process_limit_allows_work_below_it():
    code = (
        "import os\n"
        "pids = [os.fork() for _ in range(1)]\n"
        "if pids[0] == 0:\n"
        "    os._exit(0)\n"
        "os.waitpid(pids[0], 0)\n"
        "print('forked')\n"
    )
    result = run_python(code, limits=SandboxLimits(timeout_s=5.0, max_processes=4))
    assert result.ok, result.stderr
    assert result.stdout == "forked\n"


def test_background_children_are_killed_when_main_exits():
    code = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\nprint('left')"
    result = run_python(code, limits=SandboxLimits(timeout_s=10.0))
    assert result.ok, result.stderr
    assert result.duration_s < 5.0  # did not wait for the sleeper
    _assert_clean(result)


def test_child_that_leaves_the_session_is_still_killed():
    if os.geteuid() != 0:
        pytest.skip("only root runs the code under a private uid that cleanup can sweep")
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    result = run_python(code, limits=SandboxLimits(timeout_s=10.0))
    assert result.ok, result.stderr
    assert result.uid is not None
    _assert_clean(result)


def test_socket_connection_is_blocked_as_network(listener):
    port = listener.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    result = run_python(code, limits=FAST)
    assert result.error is SandboxErrorKind.NETWORK
    assert "connected" not in result.stdout
    assert "network access is disabled" in result.stderr
    assert not _accepted_any(listener)
    _assert_clean(result)


def test_caught_network_error_is_still_reported(listener):
    port = listener.getsockname()[1]
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "except OSError:\n"
        "    print('caught')\n"
    )
    result = run_python(code, limits=FAST)
    assert result.stdout == "caught\n"
    assert result.error is SandboxErrorKind.NETWORK
    assert not _accepted_any(listener)


def test_name_resolution_and_bind_are_blocked():
    for code in ("import socket\nsocket.getaddrinfo('localhost', 80)", "import socket\nsocket.socket().bind(('127.0.0.1', 0))"):
        result = run_python(code, limits=FAST)
        assert result.error is SandboxErrorKind.NETWORK, code


def test_unix_socketpair_still_works():
    result = run_python("import socket\na, b = socket.socketpair()\na.send(b'hi')\nprint(b.recv(2))", limits=FAST)
    assert result.ok, result.stderr
    assert result.stdout == "b'hi'\n"


def test_network_namespace_stops_raw_syscalls(listener):
    """The audit hook can be bypassed with ctypes; the network namespace cannot."""
    caps = sandbox_capabilities()
    if not caps.get("network_namespace", "").startswith("private"):
        pytest.skip(f"no network namespace on this machine: {caps.get('network_namespace')}")
    port = listener.getsockname()[1]
    code = (
        "import ctypes, socket, struct\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = libc.socket(2, 1, 0)\n"
        f"addr = struct.pack('!HH4s8x', 2, {port}, socket.inet_aton('127.0.0.1'))\n"
        "addr = struct.pack('=H', 2) + addr[2:]\n"
        "rc = libc.connect(fd, addr, len(addr))\n"
        "print(rc, ctypes.get_errno())\n"
    )
    result = run_python(code, limits=FAST)
    assert result.ok, result.stderr
    rc, _errno = result.stdout.split()
    assert rc == "-1"
    assert not _accepted_any(listener)


def test_network_can_be_allowed(listener):
    port = listener.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    result = run_python(code, limits=SandboxLimits(timeout_s=5.0, network=True))
    assert result.ok, result.stderr
    assert result.stdout == "connected\n"
    assert _accepted_any(listener)


def test_capabilities_report_every_limit():
    caps = sandbox_capabilities()
    for key in ("python", "cleanup", "memory", "processes", "user", "network_hook", "network_namespace", "wall_clock"):
        assert key in caps, (key, caps)
    assert all(isinstance(v, str) and v for v in caps.values())
    assert "probe" not in caps  # the probe itself ran cleanly


def test_no_process_leaks_across_many_runs():
    before = threading.active_count()
    results = [run_python("import os\nos.fork()\nprint(os.getpid())", limits=FAST) for _ in range(5)]
    for r in results:
        assert r.ok, r.stderr
        _assert_clean(r)
    assert threading.active_count() == before


# --- classification and config, as pure logic -----------------------------------------


def test_classify_outcome_precedence():
    exit_rec = {"event": "exit", "kind": "exception", "pid": 10}
    assert classify_outcome(exit_code=0, timed_out=False, records=[], main_pid=10) is None
    assert classify_outcome(exit_code=None, timed_out=True, records=[], main_pid=10) is SandboxErrorKind.TIMEOUT
    assert classify_outcome(exit_code=1, timed_out=False, records=[exit_rec], main_pid=10) is SandboxErrorKind.RUNTIME_ERROR
    # A fork bomb that also ran out the clock is a process-limit hit.
    fork_fail = {"event": "process_limit", "pid": 11}
    assert classify_outcome(exit_code=None, timed_out=True, records=[fork_fail], main_pid=10) is SandboxErrorKind.PROCESS_LIMIT
    # Network attempts win even if the code caught the error and exited 0.
    net = {"event": "network", "pid": 10}
    assert classify_outcome(exit_code=0, timed_out=False, records=[net], main_pid=10) is SandboxErrorKind.NETWORK
    # Another process's exit record does not speak for the main one.
    child_mem = {"event": "exit", "kind": "memory", "pid": 99}
    assert classify_outcome(exit_code=1, timed_out=False, records=[child_mem], main_pid=10) is SandboxErrorKind.RUNTIME_ERROR
    # Killed by SIGKILL without a record: the OOM killer.
    assert classify_outcome(exit_code=-9, timed_out=False, records=[], main_pid=10) is SandboxErrorKind.MEMORY
    assert classify_outcome(exit_code=-11, timed_out=False, records=[], main_pid=10) is SandboxErrorKind.RUNTIME_ERROR


def test_error_kind_values_are_lowercase():
    assert [k.value for k in SandboxErrorKind] == ["timeout", "memory", "process_limit", "network", "disk", "runtime_error"]


@pytest.mark.parametrize(
    "kwargs, field",
    [({"timeout_s": 0}, "timeout_s"), ({"memory_mb": 8}, "memory_mb"), ({"max_processes": 0}, "max_processes"), ({"max_output_bytes": -1}, "max_output_bytes")],
)
def test_limits_are_validated_with_the_field_name(kwargs, field):
    with pytest.raises(ValueError, match=f"SandboxLimits.{field}"):
        SandboxLimits(**kwargs)


def test_unprivileged_fallbacks_inside_the_sandbox():
    """The non-root path, exercised by running the sandbox module inside a root sandbox run."""
    if os.geteuid() != 0:
        pytest.skip("already not root: the other tests exercise the unprivileged path directly")
    # The sandbox's own modules, copied into a bare package (the inner run starts its bootstrap by path).
    files = sandbox_package()
    inner = (
        "import json, os, sys\n"
        "sys.path.insert(0, os.getcwd())\n"
        "import treerl.envs.sandbox as m\n"
        "assert m.__file__.startswith(os.getcwd()), m.__file__\n"
        "assert os.geteuid() != 0\n"
        "limits = m.SandboxLimits(timeout_s=1.0, max_processes=4, memory_mb=128)\n"
        "codes = {'ok': 'print(6 * 7)', 'loop': 'while True: pass', 'mem': 'x = bytearray(2 ** 31)',\n"
        "         'bomb': 'import os\\nwhile True: os.fork()',\n"
        "         'net': \"import socket\\nsocket.create_connection(('127.0.0.1', 9))\"}\n"
        "out = {}\n"
        "for name, code in codes.items():\n"
        "    r = m.run_python(code, limits=limits)\n"
        "    out[name] = [r.error.value if r.error else None, r.stdout, r.uid, r.enforced.get('user', ''), r.enforced]\n"
        "print(json.dumps(out))\n"
    )
    result = run_python(inner, files=files, limits=SandboxLimits(timeout_s=30.0, max_processes=64, memory_mb=1024))
    assert result.ok, result.stderr
    out = json.loads(result.stdout)
    print(json.dumps(out["ok"][4], indent=1))
    assert out["ok"][:3] == [None, "42\n", None] and "not root" in out["ok"][3]
    assert out["loop"][0] == "timeout"
    assert out["mem"][0] == "memory"
    assert out["bomb"][0] == "process_limit"
    assert out["net"][0] == "network"
