/* pause READY_FD HOLD_FD: bubblewrap's payload when the agent comes from the zygote.
   Says "mounts are done" with one byte on READY_FD, then lives until HOLD_FD (a pipe
   whose only write end the agent holds) reaches EOF: the sandbox lives as long as its
   agent. Built static (gcc -static -Os) so it runs in any image.
   On EOF it SIGKILLs every other process of the sandbox's pid namespace before it
   exits: bwrap's init waits for all its children, so an orphan (`setsid sleep 900 &`)
   would otherwise keep the sandbox alive after its agent died. It is not dumpable, so
   the sandbox's commands cannot open its descriptors through /proc.

   pause userns: the zygote's helper for a sandbox's user namespace. Unshares a new
   user namespace, says so with one byte on stdout, then waits for EOF on stdin while
   its parent (host root) writes the namespace's uid/gid maps and opens it. A static
   binary started by posix_spawn costs ~0.5 ms of CPU; a fork of the zygote ~4. */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
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
    int ready = atoi(argv[1]), hold = atoi(argv[2]);
    if (write(ready, &c, 1) != 1) return 3;
    close(ready);
    for (;;) {
        ssize_t n = read(hold, &c, 1);
        if (n == 0 || (n < 0 && errno != EINTR)) {
            kill(-1, SIGKILL); /* all but init and pause itself, in this pid namespace */
            return 0;
        }
    }
}
