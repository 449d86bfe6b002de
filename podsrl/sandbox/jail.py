"""The isolated side of a sandboxed call: run as a script (`python -I -S jail.py SPEC`) by podsrl/sandbox/box.py.

Standard library only, and little of it (no json, shutil or re: each import is paid on every call), since it runs
before anything is mounted. The steps, each for a reason:
1. unshare(2) new user, mount, PID, network, IPC and UTS namespaces; the caller (outside, in the parent user
   namespace) then writes the id maps, and says so on the `go` pipe.
2. fork: the child is PID 1 (init) of the new PID namespace. When init exits the kernel kills every process left in
   it, so nothing the program starts (setsid, double fork) outlives the call.
3. init builds a new root on a tmpfs: read-only binds of the system directories and the Python prefixes, a fresh
   /proc (of the new PID namespace only), a few /dev nodes, and the scratch directory, a size-bounded tmpfs where the
   caller's files are copied in; then pivot_root into it and detach the old root, so nothing else of the host's
   files is reachable (the home directory, the run directory, reward files, podsrl's source).
4. init forks the runner, which drops every capability (and, where the caller mapped a second id, becomes that
   unprivileged user), sets the resource limits, closes every other descriptor and execs the command.
5. init waits for the runner, kills what is left, copies the scratch's regular files back out (through a descriptor of the caller's
   directory opened before the pivot; never following a link), writes the runner's wait status on the `status`
   pipe and exits; the first process relays that status as its own (exit code, or the same signal).
"""

import ctypes
import os
import signal
import stat
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, ST_RELATIME = 1024, 2048, 1 << 21, 4096
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SCRATCH, TMP = "/scratch", "/tmp"
DEVICES = ("null", "zero", "random", "urandom")
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime")

libc = ctypes.CDLL(None, use_errno=True)


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    check(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                     data and data.encode()), f"mount {source or fstype} on {target}")


def bind_read_only(source, target):
    """`source` of the host at `target` in the new root, read-only, no set-id, no devices."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(source, target, None, MS_BIND | MS_REC)
    for point in mount_points():  # each submount too: a remount changes one mount alone
        if point == target or point.startswith(target + "/"):
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept_flags(point))


def mount_points():
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
                .replace("\\134", "\\") for line in f]


def kept_flags(point):
    """The mount's noexec and access-time flags, which a remount inside a user namespace must keep."""
    flags = os.statvfs(point).f_flag
    return (flags & (MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)) | (MS_RELATIME if flags & ST_RELATIME else 0)


def build_root(spec, root):
    """The new root's tree under `root` (a fresh tmpfs)."""
    size = f"size={spec['disk_bytes']},mode=0777"
    for where in (SCRATCH, TMP):  # first: a directory shown read-only may lie under /tmp
        os.makedirs(root + where)
        mount("tmpfs", root + where, "tmpfs", MS_NOSUID | MS_NODEV, size)
    for top in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + top
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            bind_read_only(path, root + path)
    for name in ETC:
        if os.path.exists("/etc/" + name):
            bind_read_only("/etc/" + name, root + "/etc/" + name)
    for prefix in spec["read_only"]:  # the Python prefixes, and any directory the caller names
        bind_read_only(prefix, root + prefix)
    os.makedirs(root + "/dev")
    for name in DEVICES:
        open(root + "/dev/" + name, "a").close()
        mount("/dev/" + name, root + "/dev/" + name, None, MS_BIND)
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def pivot(root):
    """`root` becomes /, the old root detached, so no path leads out."""
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(f"pivot_root: no syscall number known for {os.uname().machine}")
    check(libc.syscall(number, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def copy_tree(source, target):
    """The caller's files into the scratch (links kept as links: they resolve inside only)."""
    for name in os.listdir(source):
        src, dst = os.path.join(source, name), os.path.join(target, name)
        mode = os.lstat(src).st_mode
        if stat.S_ISLNK(mode):
            os.symlink(os.readlink(src), dst)
        elif stat.S_ISDIR(mode):
            os.mkdir(dst)
            copy_tree(src, dst)
        elif stat.S_ISREG(mode):
            with open(src, "rb") as f, open(dst, "wb") as out:
                out.write(f.read())
            os.chmod(dst, stat.S_IMODE(mode))


def remove_tree(name, dir_fd):
    """Everything in `name` (relative to `dir_fd`), links not followed."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        for entry in os.listdir(fd):
            if stat.S_ISDIR(os.lstat(entry, dir_fd=fd).st_mode):
                remove_tree(entry, fd)
            else:
                os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def give(uid):
    """The scratch's files (the caller's, copied in as root) to the runner's user."""
    os.chown(SCRATCH, uid, uid)
    for path, dirs, files in os.walk(SCRATCH):
        for name in dirs + files:
            os.lchown(os.path.join(path, name), uid, uid)


def copy_out(out_fd):
    """The scratch's directories and regular files into the caller's directory (emptied first); links and
    anything else are left behind, and nothing is followed."""
    for name in os.listdir(out_fd):
        if stat.S_ISDIR(os.lstat(name, dir_fd=out_fd).st_mode):
            remove_tree(name, out_fd)
        else:
            os.unlink(name, dir_fd=out_fd)
    for path, dirs, files in os.walk(SCRATCH):
        relative = os.path.relpath(path, SCRATCH)
        for name in dirs:
            target = os.path.normpath(os.path.join(relative, name))
            if stat.S_ISDIR(os.lstat(os.path.join(path, name)).st_mode):
                os.mkdir(target, dir_fd=out_fd)
        for name in files:
            source = os.path.join(path, name)
            try:
                fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:  # a link, or something that cannot be read
                continue
            with open(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    continue
                target = os.open(os.path.normpath(os.path.join(relative, name)),
                                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=out_fd)
                with open(target, "wb") as out:
                    while chunk := f.read(1 << 20):
                        out.write(chunk)


def drop_privileges(runner_id):
    """No capability left, none to gain by exec, and (where one is mapped) an unprivileged user."""
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last
            break
    if runner_id is not None:
        os.setgroups([])
        os.setresgid(runner_id, runner_id, runner_id)
        os.setresuid(runner_id, runner_id, runner_id)  # clears the permitted and effective sets
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable of both words: all empty
    check(libc.capset(header, data), "capset")


def run_command(spec, isolated):
    """Exec the command under the limits (isolated: without any privilege first). Returns only for an inline
    program (`spec["inline"]`, run by the caller in this interpreter, which saves an interpreter's start)."""
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # init ignores it; the program must not
        if isolated:
            drop_privileges(spec["runner_id"])
            libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # init's setting, inherited; its own /proc is its own
        import resource
        for limit, soft, hard in spec["rlimits"]:
            resource.setrlimit(limit, (soft, hard))
        if spec["inline"] is not None:
            os.environ.clear()
            os.environ.update(spec["env"])
            return spec["inline"]
        os.execve(spec["command"][0], spec["command"], spec["env"])
    except BaseException as e:  # the command could not start: said on its stderr, exit 127 as a shell does
        os.write(2, f"sandbox: cannot run {spec['command'][0]}: {e}\n".encode())
    os._exit(127)


def run_init(spec, status):
    """Init's work; returns only in the runner, with its inline program."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the first process gone (killed): all goes
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # its descriptors stay out of the runner's reach through /proc
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
    root = spec["root"]  # an empty directory of the caller's: the tmpfs on it (here alone) becomes /
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    build_root(spec, root)
    out_fd = os.open(spec["scratch"], os.O_RDONLY | os.O_DIRECTORY)
    copy_tree(spec["scratch"], root + SCRATCH)
    pivot(root)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:  # per user namespace: none nested in this one, so
        f.write("0")  # the program cannot gain capabilities (and the kernel code they reach) in a namespace of its own
    give(spec["runner_id"] if spec["runner_id"] is not None else 0)
    runner = os.fork()
    if runner == 0:
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.chdir(SCRATCH)
        return run_command(spec, isolated=True)
    _, wait_status = os.waitpid(runner, 0)
    try:  # what the program left running stops now, before its files are read
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:  # nothing left
        pass
    if spec["copy_out"]:
        copy_out(out_fd)
    os.write(status, str(wait_status).encode())
    os._exit(0)


def main():
    """The process's role: returns only in the runner, with the inline program to run (None: none)."""
    spec = eval(sys.argv[1], {"__builtins__": {}})  # the caller's repr() of a dict of plain values
    ready, go = spec["fds"]
    if not spec["isolated"]:
        os.close(ready)
        os.close(go)
        return run_command(spec, isolated=False)
    status_r, status_w = os.pipe()
    try:
        check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
                           | CLONE_NEWUTS), "unshare")
    except OSError as e:  # EPERM or ENOSPC: unprivileged user namespaces disabled, or none left to make
        os.write(2, f"sandbox: cannot isolate: no user namespace ({e.strerror})\n".encode())
        os._exit(126)
    os.write(ready, b"u")
    os.close(ready)
    if os.read(go, 1) != b"m":
        os.write(2, b"sandbox: cannot isolate: the user and group ids could not be mapped\n")
        os._exit(126)
    os.close(go)
    init = os.fork()
    if init == 0:
        try:
            return run_init(spec, status_w)
        except BaseException as e:
            os.write(2, f"sandbox: cannot isolate: {e}\n".encode())
        os._exit(126)
    os.close(status_w)
    _, code = os.waitpid(init, 0)
    report = os.read(status_r, 64)
    if not report:  # init failed (its stderr says why) or was killed
        os._exit(126 if os.WIFEXITED(code) else 125)
    status = int(report)
    if os.WIFSIGNALED(status):  # the program's signal, as the caller would have seen it without this process
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    # the inline program runs here, at the top, so that its exceptions and exit end the process as
    # `python -I -S -c PROGRAM` would (traceback and exit 1, sys.exit's code, buffers flushed)
    program = main()
    sys.argv = ["-c"]
    exec(compile(program, "<string>", "exec"), {"__name__": "__main__"})
