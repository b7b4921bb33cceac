// CoreDNS with only the plugins cluster DNS needs (the node has no route out, so no forward):
// a full build would compile every cloud provider's SDK for nothing.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// The order plugins run in (CoreDNS's plugin.cfg order, restricted to the ones compiled in).
func init() {
	dnsserver.Directives = []string{"log", "health", "ready", "errors", "cache", "kubernetes"}
}

func main() { coremain.Run() }
