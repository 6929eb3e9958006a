/* /opt/hedgerow/exec ERR_FD PROGRAM ARG...: how a zygote-started agent starts every
   command (podagent/spawn.py); built with pause, bound read-only there.

   The agent's real and saved uid are the agent uid, which no command has, so that no
   command may signal it (docs/local-backend.md, "Commands cannot signal the agent").
   A child inherits its parent's real uid, and posix_spawn cannot change it, so this
   sets every uid and gid to the effective one, raises oom_score_adj to 500 (no
   privilege needed: the OOM killer then prefers any command to the agent), makes
   ERR_FD close-on-exec and execs PROGRAM (a name without '/' searched in the PATH of
   the environment, as subprocess does; no ENOEXEC shell fallback). If the exec fails,
   its errno goes to ERR_FD (4 bytes) and the exit status is 127.

   No libc (-nostdlib, raw system calls): a static glibc binary's start-up cost ~0.6 ms
   of CPU per command, this ~0.05 ms (docs/benchmarks.md). x86_64 and aarch64. */
#include <asm/unistd.h>
#include <fcntl.h>

#define PATH_MAX_LEN 4096

static long sys(long n, long a, long b, long c) {
    long r;
#if defined(__x86_64__)
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
#elif defined(__aarch64__)
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    register long x2 __asm__("x2") = c;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2) : "memory");
    r = x0;
#else
#error "exec_helper.c: x86_64 or aarch64 only"
#endif
    return r;
}

static int has_slash(const char *s) {
    for (; *s; s++)
        if (*s == '/') return 1;
    return 0;
}

static long try_exec(const char *path, char **argv, char **envp) {
    return sys(__NR_execve, (long)path, (long)argv, (long)envp);
}

static long exec_search(char **argv, char **envp) {
    const char *name = argv[0];
    if (has_slash(name)) return try_exec(name, argv, envp);
    const char *path = "/usr/local/bin:/usr/bin:/bin";
    for (char **e = envp; *e; e++) {
        const char *v = *e;
        if (v[0] == 'P' && v[1] == 'A' && v[2] == 'T' && v[3] == 'H' && v[4] == '=') path = v + 5;
    }
    long seen_eacces = 0, err = -2; /* ENOENT */
    char buf[PATH_MAX_LEN];
    for (const char *p = path;; p++) {
        const char *start = p;
        while (*p && *p != ':') p++;
        long n = 0;
        volatile char *out = buf; /* no memcpy: there is no libc */
        if (p == start) out[n++] = '.';
        for (const char *q = start; q < p && n < PATH_MAX_LEN - 2; q++) out[n++] = *q;
        out[n++] = '/';
        for (const char *q = name; *q && n < PATH_MAX_LEN - 1; q++) out[n++] = *q;
        out[n] = 0;
        err = try_exec(buf, argv, envp);
        if (err == -13) seen_eacces = 1; /* EACCES */
        else if (err != -2 && err != -20) return err; /* neither ENOENT nor ENOTDIR */
        if (!*p) break;
    }
    return seen_eacces ? -13 : err;
}

static long parse_fd(const char *s) {
    long v = 0;
    if (!*s) return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9') return -1;
        v = v * 10 + (*s - '0');
    }
    return v;
}

__attribute__((used)) void helper_main(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1);
    char **envp = argv + argc + 1;
    long err_fd = argc >= 3 ? parse_fd(argv[1]) : -1;
    if (err_fd < 0) sys(__NR_exit_group, 2, 0, 0);
    long uid = sys(__NR_geteuid, 0, 0, 0), gid = sys(__NR_getegid, 0, 0, 0);
    long rc = sys(__NR_setresgid, gid, gid, gid);
    if (rc == 0) rc = sys(__NR_setresuid, uid, uid, uid);
    if (rc == 0) {
        long adj = sys(__NR_openat, AT_FDCWD, (long)"/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (adj >= 0) { /* best effort: without /proc the command keeps the agent's */
            sys(__NR_write, adj, (long)"500", 3);
            sys(__NR_close, adj, 0, 0);
        }
        rc = sys(__NR_fcntl, err_fd, F_SETFD, FD_CLOEXEC);
    }
    if (rc == 0) rc = exec_search(argv + 2, envp);
    int code = (int)-rc;
    sys(__NR_write, err_fd, (long)&code, sizeof code);
    sys(__NR_exit_group, 127, 0, 0);
}

#if defined(__x86_64__)
__asm__(".globl _start\n_start:\n mov %rsp, %rdi\n and $-16, %rsp\n call helper_main\n hlt\n");
#elif defined(__aarch64__)
__asm__(".globl _start\n_start:\n mov x0, sp\n bl helper_main\n");
#endif
