/* The sandbox ("pause") container of the test cluster's pods: it holds the pod's namespaces and does nothing else.
 * PID 1 of the sandbox: blocks in pause(), reaps the children it inherits, exits 0 on SIGINT or SIGTERM.
 * Built statically by scripts/image.sh (gcc -static -O2) into a one-file image. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    puts("h3serve pause");
    return 0;
  }
  if (getpid() != 1) fputs("pause: not PID 1: children are reaped only if they are ours\n", stderr);

  struct sigaction stop = {0}, child = {0};
  stop.sa_handler = on_stop;
  child.sa_handler = on_child;
  child.sa_flags = SA_NOCLDSTOP | SA_RESTART;
  if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
      sigaction(SIGCHLD, &child, NULL) < 0) {
    perror("pause: sigaction");
    return 1;
  }
  for (;;) pause();
}
