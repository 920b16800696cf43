/* The sandbox ("pause") process of every pod on the local real node: it holds the pod's
 * namespaces, reaps the orphans a shared PID namespace hands it, and exits on SIGINT or
 * SIGTERM. No pause image can be pulled here, so the node builds its own from this. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) {
    (void)sig;
    _exit(0);
}

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction stopping = {.sa_handler = stop};
    struct sigaction reaping = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    if (sigaction(SIGINT, &stopping, NULL) || sigaction(SIGTERM, &stopping, NULL) ||
        sigaction(SIGCHLD, &reaping, NULL)) {
        return 1;
    }
    for (;;) {
        pause();
    }
}
