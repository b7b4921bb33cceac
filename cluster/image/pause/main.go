// pause: the pod sandbox's init process for the hivekeeper test cluster (what registry.k8s.io/pause
// is in a normal cluster). It holds the pod's namespaces open until the kubelet stops the sandbox
// (SIGTERM or SIGINT: exit 0), and, as PID 1 of a pod that shares its process namespace, reaps the
// zombies that are re-parented to it. Built static (CGO_ENABLED=0) into a FROM-scratch image by
// cluster/image/build.sh.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

var version = "dev"

func main() {
	if len(os.Args) > 1 && (os.Args[1] == "-v" || os.Args[1] == "--version") {
		fmt.Println("hivekeeper-pause", version)
		return
	}
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			fmt.Fprintf(os.Stderr, "pause: %v, exiting\n", sig)
			os.Exit(0)
		}
		// One SIGCHLD may stand for several children: reap every one that has exited.
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
