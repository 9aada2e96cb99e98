"""The confinement that runs *inside* a sandbox process, before the untrusted program starts.

`Sandbox` starts `python -I -S -c <this file's source> <json config>` as an unprivileged uid in the
temporary working directory. In order, this code:
  1. unshares a user + network + mount namespace: no interface but a down loopback, so no network;
     private tmpfs over /tmp, /var/tmp and /dev/shm, so nothing written there survives the run;
  2. unshares a second user + mount namespace, which locks those mounts (cannot be unmounted to
     reach the host's /tmp underneath);
  3. sets RLIMIT_CPU / AS / FSIZE / NPROC / CORE (hard = soft, cannot be raised again);
  4. compiles `main.py` (exit 97 on a syntax error) and runs it as `__main__` (exit 98 on MemoryError).
Where namespaces are unavailable (step 1 fails) it falls back to an audit hook that refuses every
socket operation, and says so on stderr (`JAIL_FALLBACK_MARK`). Standard library only: this file
runs under `-I -S` with an interpreter of the sandbox's choosing.
"""
import ctypes
import json
import os
import resource
import sys

COMPILE_ERROR_EXIT = 97
MEMORY_ERROR_EXIT = 98
JAIL_FALLBACK_MARK = "moeloop-jail: network namespace unavailable, socket audit hook in use"

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
_MS_REC, _MS_PRIVATE = 1 << 14, 1 << 18
_PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _enter_userns(libc, flags):
    """unshare(flags | CLONE_NEWUSER) and map our own uid/gid to themselves; False on failure."""
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | flags) != 0:
        return False
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    return True


def _isolate(tmpfs_bytes):
    """Steps 1 and 2 of the module docstring; False when this kernel/container does not allow them."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not _enter_userns(libc, _CLONE_NEWNET | _CLONE_NEWNS):
        return False
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return False
    opts = f"size={tmpfs_bytes},mode=1777".encode()
    for path in _PRIVATE_DIRS:
        if os.path.isdir(path) and libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, opts) != 0:
            return False
    return _enter_userns(libc, _CLONE_NEWNS)


def _refuse_sockets(event, args):
    if event.startswith("socket."):
        raise PermissionError(f"network disabled in sandbox ({event})")


def _set_limits(cfg):
    pairs = {
        resource.RLIMIT_CPU: cfg["cpu_s"],
        resource.RLIMIT_AS: cfg["memory_bytes"],
        resource.RLIMIT_FSIZE: cfg["file_bytes"],
        resource.RLIMIT_NPROC: cfg["max_procs"],
        resource.RLIMIT_CORE: 0,
    }
    for which, value in pairs.items():
        resource.setrlimit(which, (value, value))


def _run_main():
    with open("main.py", encoding="utf-8", errors="replace") as f:
        source = f.read()
    try:
        code = compile(source, "main.py", "exec")
    except (SyntaxError, ValueError) as err:
        print(f"compile error: {err}", file=sys.stderr)
        os._exit(COMPILE_ERROR_EXIT)
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        os._exit(MEMORY_ERROR_EXIT)


def main():
    cfg = json.loads(sys.argv[1])
    if not cfg["network"] and not _isolate(cfg["tmpfs_bytes"]):
        sys.addaudithook(_refuse_sockets)
        print(JAIL_FALLBACK_MARK, file=sys.stderr)
    _set_limits(cfg)
    sys.argv = ["main.py"]
    _run_main()


if __name__ == "__main__":
    main()
