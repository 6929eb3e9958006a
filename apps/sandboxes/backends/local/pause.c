/* pause READY_FD HOLD_FD: bubblewrap's payload when the agent comes from the zygote,
   and the sandbox's pid 1 (bwrap --as-pid-1): the kernel delivers to a pid namespace's
   init only the signals it handles, and never SIGKILL/SIGSTOP sent from inside, so no
   command can end it (before, bwrap's init held the sandbox and pause was an ordinary
   child: `kill -9 -1` killed pause, the init then exited, and the kernel killed the
   agent with the rest). Says "mounts are done" with one byte on READY_FD, then lives
   until HOLD_FD (a pipe whose only write end the agent holds) reaches EOF: the sandbox
   lives as long as its agent. As init it reaps every orphan of the sandbox (SIGCHLD).
   On EOF it SIGKILLs every other process of the pid namespace and exits (the kernel
   then kills whatever is left). Built static (gcc -static -Os) so it runs in any
   image. It is not dumpable, so the sandbox's commands cannot open its descriptors
   through /proc.

   pause userns: the zygote's helper for a sandbox's user namespace. Unshares a new
   user namespace, says so with one byte on stdout, then waits for EOF on stdin while
   its parent (host root) writes the namespace's uid/gid maps and opens it. A static
   binary started by posix_spawn costs ~0.5 ms of CPU; a fork of the zygote ~4. */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

static void reap(int sig) {
    int saved = errno;
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {}
    errno = saved;
}

int main(int argc, char **argv) {
    char c = 'r';
    if (argc == 2 && strcmp(argv[1], "userns") == 0) {
        if (unshare(CLONE_NEWUSER) != 0) return 4;
        c = 'u';
        if (write(1, &c, 1) != 1) return 3;
        while (read(0, &c, 1) > 0) {}
        return 0;
    }
    if (argc != 3) return 2;
    /* Not dumpable: it runs as sandbox root, and a command (same uid, no capabilities)
       could otherwise open its fds through /proc: a write end of the hold pipe (pause
       would never see the agent die) or agent.log. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) return 5;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = reap;
    sa.sa_flags = SA_NOCLDSTOP; /* no SA_RESTART: the read below is interrupted */
    if (sigaction(SIGCHLD, &sa, NULL) != 0) return 6;
    reap(0); /* anything orphaned before the handler was in place */
    int ready = atoi(argv[1]), hold = atoi(argv[2]);
    if (write(ready, &c, 1) != 1) return 3;
    close(ready);
    for (;;) {
        ssize_t n = read(hold, &c, 1);
        if (n == 0 || (n < 0 && errno != EINTR)) {
            kill(-1, SIGKILL); /* all but pause itself, in this pid namespace */
            return 0;
        }
    }
}
