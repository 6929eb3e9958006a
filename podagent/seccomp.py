"""The sandbox's seccomp filter: built with libseccomp (through ctypes), loaded by the
zygote-forked agent and given to bubblewrap (``--seccomp FD``) in both launch modes.

Default allow, with the standard container default's denials (Docker/containers'
seccomp.json: the calls it only allows with a capability a sandbox never has, and the
ones it blocks outright). Denied calls fail with EPERM, as in Docker; clone3 fails with
ENOSYS so glibc falls back to clone, whose namespace flags can be inspected (clone3's
are behind a pointer). ptrace, kcmp and process_vm_readv/writev stay allowed, as in
Docker on kernels >= 4.8: since 4.8 seccomp is re-checked after a tracer changes a
syscall, so ptrace cannot bypass the filter, and the kernel's ptrace access checks
(same uid, dumpable) already keep commands away from the agent (not dumpable).
personality stays allowed: its flags (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC...) only
weaken the calling process itself, and libseccomp cannot say "none of these values"
about one argument in a default-allow filter.

No hand-assembled BPF: libseccomp compiles the rules, ``export_bpf`` gives the
program, ``load`` installs exactly those bytes (the agent runs after setns into the
sandbox, where libseccomp may not exist: the zygote compiles before forking).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from typing import Dict, List, Optional, Tuple

# Denied outright (EPERM). Grouped as in the container default's reasoning.
DENIED = (
    # kernel keyring: not namespaced by anything but the user namespace
    "add_key",
    "keyctl",
    "request_key",
    # kernel code, modules, reboot
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "create_module",
    "get_kernel_syms",
    "query_module",
    "reboot",
    # tracing / introspection of the kernel
    "bpf",
    "perf_event_open",
    "lookup_dcookie",
    "syslog",
    "userfaultfd",
    # mounts and namespaces (a sandbox is entered once, by its launcher)
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "setns",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "open_by_handle_at",
    "name_to_handle_at",
    # machine-wide state
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "quotactl_fd",
    "settimeofday",
    "stime",
    "clock_settime",
    "clock_adjtime",
    "nfsservctl",
    "_sysctl",
    "sysfs",
    "ustat",
    "uselib",
    "vhangup",
    # raw hardware
    "iopl",
    "ioperm",
    "vm86",
    "vm86old",
    # io_uring: its operations bypass this filter (newer Docker blocks it too)
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
)
ENOSYS_CALLS = ("clone3",)
# clone/unshare stay allowed (threads, fork, CLONE_FILES...) except with a namespace flag
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID = 0x08000000, 0x10000000, 0x20000000
CLONE_NEWNET, CLONE_NEWTIME = 0x40000000, 0x00000080
NAMESPACE_FLAGS = (
    CLONE_NEWNS,
    CLONE_NEWCGROUP,
    CLONE_NEWUTS,
    CLONE_NEWIPC,
    CLONE_NEWUSER,
    CLONE_NEWPID,
    CLONE_NEWNET,
)
# the flag argument's index: clone(flags, ...) on x86 (s390 swaps the first two: not
# a target), unshare(flags)
FLAG_ARG = {"clone": 0, "unshare": 0}

_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_MASKED_EQ = 7
# other ABIs the kernel accepts on this one: the rules must cover them too
_COMPAT_ARCHES = {"x86_64": ("x86", "x32"), "aarch64": ("arm",)}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
_BPF_INSN_SIZE = 8  # struct sock_filter


class SeccompError(OSError):
    """libseccomp is missing or refused the profile."""


def _act_errno(err: int) -> int:
    return 0x00050000 | (err & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise SeccompError(errno.ENOENT, f"libseccomp is not installed: {exc}") from exc
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


# (syscall, action, (argument index, mask, value) or None): matches when the argument
# masked equals the value
Rule = Tuple[str, int, Optional[Tuple[int, int, int]]]


def rules() -> List[Rule]:
    """The profile as data."""
    out: List[Rule] = [(name, _act_errno(errno.EPERM), None) for name in DENIED]
    out += [(name, _act_errno(errno.ENOSYS), None) for name in ENOSYS_CALLS]
    for name, index in FLAG_ARG.items():
        out += [(name, _act_errno(errno.EPERM), (index, flag, flag)) for flag in NAMESPACE_FLAGS]
    out.append(("unshare", _act_errno(errno.EPERM), (0, CLONE_NEWTIME, CLONE_NEWTIME)))
    return out


# The agent's pid in its sandbox (pause is 1; the agent is the next process there).
AGENT_PID = 2
_PID_MASK = 0xFFFFFFFF  # pid_t is an int: -1 arrives as 0xffffffff in the low half


def guard_rules(agent_uid: int) -> List[Rule]:
    """A second filter, for agents whose commands keep capabilities (an OCI image's
    root: Docker's default set, CAP_KILL and CAP_SETUID included, over the user
    namespace the agent is in, where the agent's own uid does not protect it): no
    signal to the agent's pid, its process group or -1 (everything), no pidfd of it,
    and no uid switch to the agent's uid. Loaded by the agent itself after its own
    uid switch (it never does any of these), so every command inherits it."""
    eperm = _act_errno(errno.EPERM)
    out: List[Rule] = []
    for name in ("kill", "tkill", "rt_sigqueueinfo", "pidfd_open"):
        for pid in (AGENT_PID, -AGENT_PID, -1):
            out.append((name, eperm, (0, _PID_MASK, pid & _PID_MASK)))
    for name in ("tgkill", "rt_tgsigqueueinfo"):  # (tgid, tid, ...)
        out += [(name, eperm, (index, _PID_MASK, AGENT_PID)) for index in (0, 1)]
    # a pidfd may also be an open /proc/<pid> directory
    out.append(("pidfd_send_signal", eperm, None))
    for name, count in (("setuid", 1), ("setreuid", 2), ("setresuid", 3)):
        for variant in (name, name + "32"):
            out += [(variant, eperm, (i, _PID_MASK, agent_uid)) for i in range(count)]
    return out


def nice_rules(agent_uid: int) -> List[Rule]:
    """A filter every sandboxed agent loads for its commands: no lowering the agent's
    priority. A command's effective uid is the agent's, which is all ``setpriority``
    (and sched/ioprio changes) compare, so ``renice 19 <agent>``, ``SCHED_IDLE`` or a
    one-CPU affinity would let a busy command starve the agent into answering late, a
    route to an ``environment`` verdict. Refused: the agent's pid (or its process
    group: same number) and, for ``setpriority``/``ioprio_set``'s PRIO_USER, the
    agent's uid. The agent never does any of these to itself."""
    eperm = _act_errno(errno.EPERM)
    out: List[Rule] = [
        ("setpriority", eperm, (1, _PID_MASK, AGENT_PID)),
        ("setpriority", eperm, (1, _PID_MASK, agent_uid)),
        ("ioprio_set", eperm, (1, _PID_MASK, AGENT_PID)),
        ("ioprio_set", eperm, (1, _PID_MASK, agent_uid)),
    ]
    for name in ("sched_setscheduler", "sched_setparam", "sched_setattr", "sched_setaffinity"):
        out.append((name, eperm, (0, _PID_MASK, AGENT_PID)))
    return out


def compile_filter(rule_list: Optional[List[Rule]] = None) -> bytes:
    """The profile (or ``rule_list``) as a classic BPF program (struct sock_filter[]),
    for this machine's architecture and its compat ABIs."""
    lib = _libseccomp()
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise SeccompError(errno.ENOMEM, "seccomp_init failed")
    try:
        for arch in _COMPAT_ARCHES.get(os.uname().machine, ()):
            token = lib.seccomp_arch_resolve_name(arch.encode())
            rc = lib.seccomp_arch_add(ctx, token)
            if rc != 0 and rc != -errno.EEXIST:
                raise SeccompError(-rc, f"seccomp_arch_add({arch}): {os.strerror(-rc)}")
        for name, action, flag in rules() if rule_list is None else rule_list:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr == -1:  # __NR_SCMP_ERROR: a name this libseccomp does not know
                raise SeccompError(errno.EINVAL, f"libseccomp does not know syscall {name!r}")
            count = 0 if flag is None else 1
            cmp = (_ArgCmp * 1)()
            if flag is not None:
                cmp[0] = _ArgCmp(flag[0], _SCMP_CMP_MASKED_EQ, flag[1], flag[2])
            rc = lib.seccomp_rule_add_array(ctx, action, nr, count, cmp)
            if rc != 0:
                raise SeccompError(-rc, f"seccomp rule for {name}: {os.strerror(-rc)}")
        fd = os.memfd_create("seccomp", os.MFD_CLOEXEC)
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc != 0:
                raise SeccompError(-rc, f"seccomp_export_bpf: {os.strerror(-rc)}")
            return os.pread(fd, os.fstat(fd).st_size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


_cache: Dict[str, bytes] = {}


def program() -> bytes:
    """``compile_filter()``, once per process."""
    if "bpf" not in _cache:
        _cache["bpf"] = compile_filter()
    return _cache["bpf"]


def memfd(bpf: bytes) -> int:
    """A fresh (inheritable: for bwrap) fd whose content is ``bpf``, at offset 0."""
    fd = os.memfd_create("hedgerow-seccomp", 0)
    os.write(fd, bpf)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# looked up at import: a zygote-forked agent loads two or three filters, and building a
# CDLL and its function objects per load wrote to (copied) the zygote's pages
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def load(bpf: bytes) -> None:
    """Installs ``bpf`` on the calling thread (no_new_privs must be set already); it is
    inherited by every child."""
    if not bpf or len(bpf) % _BPF_INSN_SIZE:
        raise SeccompError(errno.EINVAL, f"not a BPF program ({len(bpf)} bytes)")
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // _BPF_INSN_SIZE, ctypes.cast(buf, ctypes.c_void_p))
    rc = _PRCTL(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0)
    if rc != 0:
        err = ctypes.get_errno()
        raise SeccompError(err, f"PR_SET_SECCOMP: {os.strerror(err)}")
