"""Escapes from the code sandbox that once worked, each with its reproducer: now every one is held.

Each test runs the reproducer through :func:`run_python` on this machine as it is (root or
not). A test skips only where the mechanism it checks cannot exist here, and says why
(from :func:`sandbox_capabilities`). ``test_escapes_held_without_root`` runs the same
reproducers through the unprivileged path (user namespaces), from inside a root run.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from pathlib import Path

import pytest
from _helpers import sandbox_package

import treerl
from treerl.envs.sandbox import (
    SandboxErrorKind,
    SandboxLimits,
    run_python,
    sandbox_capabilities,
)

FAST = SandboxLimits(timeout_s=5.0)
CHECKOUT_FILE = Path(treerl.__file__).resolve()


@pytest.fixture(scope="module")
def caps() -> dict[str, str]:
    return sandbox_capabilities()


def _need(caps: dict[str, str], key: str) -> None:
    value = caps.get(key, "absent")
    if value.startswith(("not enforced", "absent", "unavailable", "refused")):
        pytest.skip(f"{key} cannot be enforced on this machine: {value}")


# The reproducers: each prints what it managed to do; an empty or "blocked" line means held.
READ_FILES = (
    "import sys\n"
    "for path in sys.argv[1:] or {paths!r}:\n"
    "    try:\n"
    "        print(path, 'READ', open(path).read(40).replace(chr(10), ' '))\n"
    "    except OSError as e:\n"
    "        print(path, 'blocked', type(e).__name__)\n"
)
PARENT_CMDLINE = (
    "import os\n"
    "print('pid', os.getpid(), 'ppid', os.getppid())\n"
    "print('visible', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
    "for pid in {{os.getppid(), {host_pid}}}:\n"
    "    try:\n"
    "        print(pid, 'READ', open('/proc/%d/cmdline' % pid, 'rb').read()[:80])\n"
    "    except OSError as e:\n"
    "        print(pid, 'blocked', type(e).__name__)\n"
)
UNIX_SOCKET = (
    "import socket\n"
    "for address in {addresses!r}:\n"
    "    s = socket.socket(socket.AF_UNIX)\n"
    "    try:\n"
    "        s.connect(address)\n"
    "        s.sendall(b'escaped')\n"
    "        print(repr(address), 'CONNECTED')\n"
    "    except OSError as e:\n"
    "        print(repr(address), 'blocked', type(e).__name__)\n"
)
LEAVE_FILES = (
    "import ctypes, os\n"
    "for path in ('/tmp/{tag}', '/dev/shm/{tag}'):\n"
    "    with open(path, 'wb') as f:\n"
    "        f.write(b'x' * 4096)\n"
    "    print('wrote', path)\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "key = {key}\n"
    "print('shmget', libc.shmget(key, 4096, 0o1666))  # IPC_CREAT | 0666: a System V segment\n"
)
FORK_MEMORY = (
    "import os, time\n"
    "kids = []\n"
    "for i in range({children}):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        block = bytearray({each_mb} * 1024 * 1024)\n"
    "        for j in range(0, len(block), 4096):\n"
    "            block[j] = 1  # touch every page, so that it is resident\n"
    "        print('child holds', {each_mb}, 'MiB', flush=True)\n"
    "        time.sleep(20)\n"
    "        os._exit(0)\n"
    "    kids.append(pid)\n"
    "for pid in kids:\n"
    "    os.waitpid(pid, 0)\n"
    "print('all children done')\n"
)
FILL_DISK = (
    "import os\n"
    "chunk = b'x' * (1024 * 1024)\n"
    "written = 0\n"
    "with open('{path}', 'wb') as f:\n"
    "    while written < {limit_mb} * 4:\n"
    "        f.write(chunk)\n"
    "        f.flush()\n"
    "        written += 1\n"
    "print('wrote', written, 'MiB')\n"
)
FORGE = (
    "import json, os, sys\n"
    "forged = [{'event': 'setup', 'pid': os.getpid(), 'main_pid': os.getpid(), 'enforced': {'filesystem': 'FORGED'}},\n"
    "          {'event': 'exit', 'code': 0}, {'event': 'exit', 'kind': 'memory', 'code': 0, 'pid': os.getpid()}]\n"
    "line = ''.join(json.dumps(r) + '\\n' for r in forged).encode()\n"
    "fds = sorted(int(fd) for fd in os.listdir('/proc/self/fd'))\n"
    "print('fds', fds)\n"
    "for fd in range(3, 1024):\n"
    "    try:\n"
    "        os.write(fd, line * 1000)\n"
    "    except OSError:\n"
    "        pass\n"
    "sys.exit(EXIT_CODE)\n"
)

HOST_FILES = (
    "import fcntl, os, stat\n"
    "for fd in range(1024):\n"
    "    try:\n"
    "        mode, flags = os.fstat(fd).st_mode, fcntl.fcntl(fd, fcntl.F_GETFL)\n"
    "    except OSError:\n"
    "        continue\n"
    "    if stat.S_ISREG(mode) and flags & os.O_ACCMODE != os.O_RDONLY:\n"
    "        print('writable file', fd)\n"
    "try:\n"
    "    open('/proc/self/fd/0', 'ab').write(b'x' * 4096)\n"
    "    print('reopened stdin for writing')\n"
    "except OSError:\n"
    "    pass\n"
    "print('checked')\n"
)

PLANT = (
    "import errno, os, sysconfig\n"
    "for d in (sysconfig.get_paths()['purelib'], os.path.dirname(os.__file__), '/', '/tmp/..'):\n"
    "    try:\n"
    "        open(os.path.join(d, 'planted.pth'), 'w').write('import os')\n"
    "        print(d, 'WROTE')\n"
    "    except OSError as e:\n"
    "        print(d, errno.errorcode[e.errno])\n"
)


def test_world_readable_files_are_not_visible(caps):
    """Was: /etc/passwd and the project checkout readable from the sandbox."""
    _need(caps, "filesystem")
    paths = ["/etc/passwd", "/etc/hostname", str(CHECKOUT_FILE), str(Path(__file__).resolve())]
    result = run_python(READ_FILES.format(paths=paths), limits=FAST)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(paths) and all(" blocked " in line for line in lines), result.stdout
    # What the code still needs is there: the interpreter's own library reads fine.
    stdlib = run_python("import json, os\nprint(os.path.exists(json.__file__))", limits=FAST)
    assert stdlib.stdout == "True\n", stdlib.stderr


def test_interpreter_and_its_packages_are_read_only(caps):
    """A plain user owns their venv: without a read-only view, code could plant a ``.pth`` that runs later."""
    _need(caps, "filesystem")
    result = run_python(PLANT, limits=FAST)
    lines = result.stdout.splitlines()
    assert len(lines) == 4 and all(line.endswith(" EROFS") for line in lines), result.stdout + result.stderr


def test_parent_command_line_is_not_visible(caps):
    """Was: /proc/<ppid>/cmdline showed the parent's command line (keys passed as flags)."""
    _need(caps, "pid_namespace")
    result = run_python(PARENT_CMDLINE.format(host_pid=os.getpid()), limits=FAST)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "pid 1 ppid 0"  # pid 1 of its own namespace; the parent is outside it
    assert lines[1] == "visible [1]"
    assert all(" blocked " in line for line in lines[2:]) and len(lines) == 4, result.stdout


def test_unix_socket_of_the_parent_is_unreachable(caps, tmp_path):
    """Was: code connected to a unix socket the parent had opened at a path (and abstract ones)."""
    _need(caps, "filesystem")
    _need(caps, "network_namespace")
    path = str(tmp_path / "parent.sock")
    abstract = "\0treerl-test-" + secrets.token_hex(6)
    servers = []
    for address in (path, abstract):
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(address)
        srv.listen(4)
        srv.setblocking(False)
        servers.append(srv)
    try:
        result = run_python(UNIX_SOCKET.format(addresses=[path, abstract]), limits=FAST)
        assert result.ok, result.stderr
        assert "CONNECTED" not in result.stdout and result.stdout.count("blocked") == 2, result.stdout
        for srv in servers:
            with pytest.raises(BlockingIOError):
                srv.accept()
    finally:
        for srv in servers:
            srv.close()


def test_nothing_is_left_in_tmp_or_shared_memory(caps):
    """Was: files in /tmp and /dev/shm (RAM) outlived the run; so would System V segments."""
    _need(caps, "filesystem")
    tag = "treerl-escape-" + secrets.token_hex(6)
    key = secrets.randbelow(1 << 30) + 1
    result = run_python(LEAVE_FILES.format(tag=tag, key=key), limits=FAST)
    assert result.ok, result.stderr
    assert result.stdout.count("wrote") == 2, result.stdout
    assert not os.path.exists(f"/tmp/{tag}") and not os.path.exists(f"/dev/shm/{tag}")
    segment = result.stdout.split("shmget ")[1].strip()
    assert segment != "-1", "the reproducer should have made a segment inside the sandbox"
    with open("/proc/sysvipc/shm") as f:
        assert all(line.split()[0] != str(key) for line in f.readlines()[1:])
    # And the next run starts with empty /tmp and /dev/shm.
    # (The working directory and an interpreter that lives under /tmp are mounted there; nothing else.)
    after = run_python("import os, sys\nmounted = [os.getcwd() + '/', sys.prefix + '/']\n"
                       "print([p for p in os.listdir('/tmp') if not any(m.startswith('/tmp/' + p + '/') "
                       "for m in mounted)], os.listdir('/dev/shm'))", limits=FAST)
    assert after.stdout == "[] []\n", after.stdout + after.stderr


def test_forked_children_share_one_memory_limit(caps):
    """Was: 14 children reached 3.3 GB under memory_mb=512 (the limit was per process)."""
    limits = SandboxLimits(timeout_s=15.0, memory_mb=128, disk_mb=16, max_processes=16)
    result = run_python(FORK_MEMORY.format(children=5, each_mb=100), limits=limits)
    # Each child alone is under the per-process limit; together they are four times over.
    assert result.error is SandboxErrorKind.MEMORY, (result.error, result.stdout, result.stderr, caps["memory_total"])
    assert "all children done" not in result.stdout
    assert result.duration_s < 10.0


def test_disk_writes_are_bounded_for_the_whole_run(caps):
    """Was: 5 GiB written to the working directory, 1 GiB to RAM-backed /dev/shm."""
    limits = SandboxLimits(timeout_s=15.0, disk_mb=16)
    result = run_python(FILL_DISK.format(path="big.bin", limit_mb=16), limits=limits)
    assert result.error is SandboxErrorKind.DISK, (result.error, result.stdout, result.stderr)
    assert "wrote" not in result.stdout


def test_tmp_and_shared_memory_count_against_the_same_quota(caps):
    _need(caps, "filesystem")
    limits = SandboxLimits(timeout_s=15.0, disk_mb=16)
    code = FILL_DISK.format(path="/tmp/a.bin", limit_mb=1) + FILL_DISK.format(path="/dev/shm/b.bin", limit_mb=1)
    result = run_python(code, limits=limits)  # 4 MiB + 4 MiB fit in 16 MiB; 12 MiB more do not
    assert result.ok, result.stderr
    more = code + FILL_DISK.format(path="c.bin", limit_mb=3)
    over = run_python(more, limits=limits)
    assert over.error is SandboxErrorKind.DISK and over.stdout.count("wrote") == 2, (over.stdout, over.stderr)


def test_the_result_cannot_be_forged(caps):
    """Was: writing to the inherited status descriptor forged the run's result (a clean exit read as ``memory``)."""
    honest = run_python("pass", limits=FAST)
    clean = run_python(FORGE.replace("EXIT_CODE", "0"), limits=FAST)
    assert clean.ok and clean.error is None, (clean.error, clean.stderr)
    result = run_python(FORGE.replace("EXIT_CODE", "7"), limits=FAST)
    assert result.exit_code == 7 and result.error is SandboxErrorKind.RUNTIME_ERROR, (result.exit_code, result.stderr)
    assert "FORGED" not in json.dumps(result.enforced)
    assert {k: v for k, v in result.enforced.items() if k != "user"} == {k: v for k, v in honest.enforced.items() if k != "user"}
    fds = json.loads(result.stdout.split("fds ", 1)[1].splitlines()[0])
    # stdin, stdout, stderr, the event file (untrusted hints), and the listing's own descriptor.
    assert len(fds) <= 5, fds


def test_no_host_file_is_open_for_writing():
    """The event records travel on a pipe: the code holds no host file it could grow past its disk quota."""
    result = run_python(HOST_FILES, stdin="input", limits=FAST)
    assert result.ok and result.stdout == "checked\n", (result.stdout, result.stderr)


def test_code_runs_in_its_own_pid_namespace(caps):
    _need(caps, "pid_namespace")
    code = "import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()\nprint(os.getpid(), sorted(os.listdir('/proc'))[:1])"
    result = run_python(code, limits=FAST)
    assert result.ok, result.stderr
    assert result.stdout.split()[0] == "1"


def test_escapes_held_without_root():
    """The same reproducers through the unprivileged path: the sandbox run as a plain user."""
    if os.geteuid() != 0:
        pytest.skip("already not root: the tests above exercise the unprivileged path directly")
    # The sandbox's own modules in a bare package (see test_unprivileged_fallbacks_inside_the_sandbox).
    files = sandbox_package()
    tag = "treerl-escape-" + secrets.token_hex(6)
    probes = {
        # OUTER_CWD: the root run's working directory, the host filesystem as the inner runs see it.
        "read": READ_FILES.format(paths=["/etc/passwd", str(CHECKOUT_FILE), "OUTER_CWD/probes.json"]),
        "cmdline": PARENT_CMDLINE.format(host_pid=1),
        "leave": LEAVE_FILES.format(tag=tag, key=secrets.randbelow(1 << 30) + 1),
        "memory": FORK_MEMORY.format(children=5, each_mb=100),
        "disk": FILL_DISK.format(path="big.bin", limit_mb=16),
        "forge": FORGE.replace("EXIT_CODE", "7"),
        "forge_clean": FORGE.replace("EXIT_CODE", "0"),
        "host_files": HOST_FILES,
        "plant": PLANT,
    }
    files["probes.json"] = json.dumps(probes)
    inner = (
        "import json, logging, os, sys\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "sys.path.insert(0, os.getcwd())\n"
        "import treerl.envs.sandbox as m\n"
        "assert os.geteuid() != 0\n"
        "out = {}\n"
        "for namespaces in (True, False):\n"
        "    limits = m.SandboxLimits(timeout_s=10.0, memory_mb=128, disk_mb=16, max_processes=16, namespaces=namespaces)\n"
        "    for name, code in json.load(open('probes.json')).items():\n"
        "        r = m.run_python(code.replace('OUTER_CWD', os.getcwd()), stdin='input', limits=limits)\n"
        "        out[name + ('' if namespaces else '_degraded')] = [r.error.value if r.error else None, r.exit_code, r.stdout, r.enforced]\n"
        f"    out['left' + ('' if namespaces else '_degraded')] = [os.path.exists('/tmp/{tag}'), os.path.exists('/dev/shm/{tag}')]\n"
        "print(json.dumps(out))\n"
    )
    result = run_python(inner, files=files, limits=SandboxLimits(timeout_s=90.0, max_processes=64, memory_mb=2048))
    assert result.ok, result.stderr
    out = json.loads(result.stdout)
    enforced = out["read"][3]
    assert enforced["user"].startswith("the caller's user"), enforced
    assert all(" blocked " in line for line in out["read"][2].splitlines()), out["read"]
    assert out["cmdline"][2].splitlines()[:2] == ["pid 1 ppid 0", "visible [1]"], out["cmdline"]
    assert out["leave"][0] is None and out["left"] == [False, False], (out["leave"], out["left"])
    assert out["memory"][0] == "memory", out["memory"]
    assert out["disk"][0] == "disk", out["disk"]
    assert out["forge"][:2] == ["runtime_error", 7] and "FORGED" not in json.dumps(out["forge"][3])
    assert out["forge_clean"][:2] == [None, 0], out["forge_clean"]
    assert out["host_files"][2] == "checked\n", out["host_files"]
    assert all(line.endswith(" EROFS") for line in out["plant"][2].splitlines()), out["plant"]
    # Without namespaces (a machine that allows none): the files are visible and /tmp is shared,
    # and the run says so, in its table and once in the log; the other limits still hold.
    degraded = out["read_degraded"][3]
    assert degraded["filesystem"].startswith("not enforced") and degraded["pid_namespace"].startswith("not enforced")
    assert "sandbox: filesystem: not enforced" in result.stderr
    assert "probes.json READ" in out["read_degraded"][2] and out["left_degraded"] == [True, True]
    assert out["memory_degraded"][0] == "memory", out["memory_degraded"]
    assert out["disk_degraded"][0] == "disk", out["disk_degraded"]
    assert out["forge_degraded"][:2] == ["runtime_error", 7] and "FORGED" not in json.dumps(out["forge_degraded"][3])
    assert out["forge_clean_degraded"][:2] == [None, 0], out["forge_clean_degraded"]


def test_without_namespaces_the_run_says_what_is_not_enforced():
    """A machine that allows no namespaces (here: turned off): the run works, says so, and keeps the rest."""
    import treerl.envs.sandbox as sandbox

    limits = SandboxLimits(timeout_s=10.0, disk_mb=16, namespaces=False)
    # Only what is already loaded: as root without a mount namespace the code runs as a private
    # uid, which cannot read an interpreter kept under a closed home directory (as on this machine).
    result = run_python("print(sum(range(16)))", limits=limits)
    assert result.ok and result.stdout == "120\n", result.stderr
    for key in ("filesystem", "pid_namespace", "network_namespace"):
        assert result.enforced[key].startswith("not enforced"), (key, result.enforced[key])
        assert f"sandbox: {key}: {result.enforced[key]}" in sandbox._logged
    assert result.enforced["disk"].startswith("RLIMIT_FSIZE")
    disk = run_python(FILL_DISK.format(path="big.bin", limit_mb=16), limits=limits)
    assert disk.error is SandboxErrorKind.DISK, (disk.error, disk.stderr)
