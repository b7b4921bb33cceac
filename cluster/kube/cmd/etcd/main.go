// etcd, built from the etcd server module that Kubernetes itself depends on (so the version
// matches the apiserver's client), for the real-cluster test tier.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
