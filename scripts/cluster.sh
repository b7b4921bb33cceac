#!/usr/bin/env bash
# A real Kubernetes on this machine, for the end-to-end tier: a control plane (etcd,
# kube-apiserver with RBAC and service-account tokens, kube-controller-manager, kube-scheduler)
# and one node (kubelet, containerd, runc, CNI, kube-proxy, CoreDNS), all inside one network
# namespace with no route out. Every binary is built here from upstream source through the Go
# module proxy (cluster/kube, cluster/coredns); containerd, runc and the CNI plugins are Debian's.
# The project's image is built from its Dockerfile by buildah (cluster/image/build.sh) and
# imported into the node's containerd.
#
#   scripts/cluster.sh build     build what is missing (cached under $HIVEKEEPER_CACHE): the
#                                binaries and the images (also alone: `binaries`, `images`)
#   scripts/cluster.sh up [b]    build, start, wait for the node; writes .cluster/kubeconfig
#   scripts/cluster.sh down [b]  stop every process it started, remove its namespaces and mounts
#   scripts/cluster.sh wan up | wan down
#                                join lab a's and lab b's nodes through a WAN (below)
#   scripts/cluster.sh labs up | labs down
#                                both labs' clusters and the WAN between them, up or down
#   scripts/cluster.sh load [b]  rebuild the image and import it into the running cluster (pods
#                                started afterwards run it; `kubectl rollout restart` the others)
#   scripts/cluster.sh env [b]   print KUBECONFIG=... and the image names
#
# Two labs: `a` (the default) and `b` are two clusters, each with its own control plane, node,
# network namespace, containerd and state (.cluster/ and .cluster-b/), for the tier where labs
# pool their clusters. `wan up` joins their nodes through a WAN namespace, as two labs' sites
# are joined by the internet: each node gets a public address (lab a 203.0.113.2, lab b
# 203.0.113.6; TEST-NET-3, never routed anywhere), every packet between them is delayed 20 ms
# each way (40 ms round trip: bench/wandelay, since this kernel has no netem) and capped at
# 100 Mbit/s ($HIVEKEEPER_WAN_MBIT; tc tbf), and pods reach the other lab masqueraded behind
# their node's public address, as a cloud's NAT gateway does.
#
# The host reaches each API server at https://$NODE_IP:6443 through a veth pair into its node's
# namespace, and both public addresses the same way; pods reach it through the `kubernetes`
# Service. Built binaries and images are kept in $HIVEKEEPER_CACHE (default
# ~/.cache/hivekeeper) so a second run on one machine is quick; a cluster's own state
# (certificates, etcd, kubelet, containerd) lives in .cluster/ (lab b's: .cluster-b/).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
K8S_VERSION=1.34.4
CACHE="${HIVEKEEPER_CACHE:-$HOME/.cache/hivekeeper}"
BIN="$CACHE/kube-v$K8S_VERSION/bin"
DOMAIN=cluster.local
WAN_NS=hk-wan
WAN_RATE_MBIT=${HIVEKEEPER_WAN_MBIT:-100}
WAN_RUN=/run/hivekeeper-wan  # the delay line's pid

# lab a|b: the names and addresses of one lab's cluster. Lab a's are also what the tools that
# know only one cluster use (.cluster/, hk-node).
lab() {
    LAB=${1:-a}
    # CGROUP_ROOT: the kubelet's cgroups (lab a's pods under /kubepods, lab b's under /hk-b/kubepods)
    case "$LAB" in
        a) local suffix="" n=0; CGROUP_ROOT=/ ;;
        b) local suffix="-b" n=1; CGROUP_ROOT=/hk-b ;;
        *) die "unknown lab '$LAB': a or b" ;;
    esac
    # containerd's content and snapshots outlive the cluster, so an image imported once is not
    # unpacked again (a 5.8 GB archive takes about 3 min); its containers do not.
    CONTAINERD_ROOT="$CACHE/containerd$suffix"
    STATE="$ROOT/.cluster$suffix"
    RUN=/run/hivekeeper-cluster$suffix     # sockets: their paths must stay short
    NS=hk-node$suffix                        # the node's network namespace
    NODE=hk-node$suffix                      # the node's name
    HOST_VETH=hk-host$suffix
    NODE_IP=198.18.0.$((4 * n + 2))          # RFC 2544 benchmark range: never routed anywhere
    HOST_IP=198.18.0.$((4 * n + 1))
    PUBLIC_IP=203.0.113.$((4 * n + 2))       # the node's address on the WAN (`wan up`)
    WAN_GATEWAY=203.0.113.$((4 * n + 1))
    POD_CIDR=10.$((244 + n)).0.0/24
    SERVICE_CIDR=10.$((96 + n)).0.0/16
    API_SERVICE_IP=10.$((96 + n)).0.1
    CLUSTER_NAME=hivekeeper-e2e$suffix
}
DEBIAN_PACKAGES=(containerd runc containernetworking-plugins iptables openssl)
# Host-wide sysctls the kubelet sets at start; `down` puts back what was there before.
KUBELET_SYSCTLS=(vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys kernel/keys/root_maxbytes)

log() { printf '[cluster %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "error: $*"; exit 1; }
in_node() { nsenter --net="/run/netns/$NS" "$@"; }
# kubectl: the pinned static build scripts/get-helm.sh puts beside helm (1.33, within the one
# minor version of skew Kubernetes supports), not built here.
KUBECTL="$ROOT/.tools/bin/kubectl"
kubectl_() { "$KUBECTL" --kubeconfig "$STATE/kubeconfig" "$@"; }
ctr_() { ctr --address "$RUN/containerd.sock" -n k8s.io "$@"; }
# kubepods: the cgroup path (as /proc/PID/cgroup names it) under which this lab's pods run.
kubepods() { if [ "$CGROUP_ROOT" = / ]; then echo /kubepods; else echo "$CGROUP_ROOT/kubepods"; fi; }

# --- build ------------------------------------------------------------------------------------

install_packages() {
    local missing=() p
    for p in "${DEBIAN_PACKAGES[@]}"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return
    log "apt-get install ${missing[*]}"
    "$ROOT/scripts/apt-install.sh" --no-install-recommends "${missing[@]}"
    # Debian starts the packaged containerd as a service where an init runs; this cluster
    # runs its own, with its own root and socket.
}

# Builds the Go binaries when the module files that pin them changed (a stamp of their hash).
# CI builds them in the background while `up` may wait for that build here; the lock's file
# descriptor is closed again before anything is started (daemons would inherit it).
build_binaries() {
    mkdir -p "$BIN"
    exec 7>"$BIN/../.build.lock"
    if ! flock -n 7; then
        log "another build of the binaries is running: waiting for it"
        flock 7
    fi
    local code=0
    build_binaries_locked || code=$?
    exec 7>&-
    return "$code"
}

build_binaries_locked() {
    local stamp="$BIN/.stamp" want
    want="$(cat "$ROOT"/cluster/kube/go.mod "$ROOT"/cluster/kube/go.sum "$ROOT"/cluster/kube/cmd/*/*.go \
                "$ROOT"/cluster/coredns/go.mod "$ROOT"/cluster/coredns/go.sum "$ROOT"/cluster/coredns/*.go | sha256sum | cut -c1-16)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        log "Kubernetes v$K8S_VERSION, etcd and CoreDNS binaries: cached in $BIN"
        return
    fi
    mkdir -p "$BIN"
    local ld="-s -w" p start=$SECONDS
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ld+=" -X $p.gitVersion=v$K8S_VERSION -X $p.gitMajor=${K8S_VERSION%%.*} -X $p.gitMinor=$(cut -d. -f2 <<<"$K8S_VERSION")"
        ld+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
    done
    log "building Kubernetes v$K8S_VERSION and etcd from the Go module proxy (cold: about 15 min on 2 cores)"
    (cd "$ROOT/cluster/kube" && go build -trimpath -ldflags "$ld" -o "$BIN/" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet \
        k8s.io/kubernetes/cmd/kube-proxy ./cmd/etcd) || return 1
    log "building CoreDNS"
    (cd "$ROOT/cluster/coredns" && go build -trimpath -ldflags "-s -w" -o "$BIN/coredns" .) || return 1
    echo "$want" > "$stamp"
    log "binaries built in $((SECONDS - start)) s"
}

cmd_binaries() {
    [ "$(id -u)" = 0 ] || die "a node needs root (network namespaces, mounts, cgroups)"
    command -v go >/dev/null || die "go not found: the binaries are built from source"
    install_packages
    build_binaries
}

cmd_images() {
    "$ROOT/cluster/image/build.sh" >/dev/null
}

cmd_build() {
    cmd_binaries
    cmd_images
}

# --- certificates and kubeconfigs -------------------------------------------------------------

# cert NAME CN [O] [SANS]: a key and a certificate signed by the cluster's CA.
cert() {
    local name=$1 cn=$2 org=${3:-} sans=${4:-} subj="/CN=$2" ext
    [ -n "$org" ] && subj="/O=$org/CN=$cn"
    ext="$(mktemp)"
    {
        echo "basicConstraints=CA:FALSE"
        echo "keyUsage=critical,digitalSignature"
        echo "extendedKeyUsage=serverAuth,clientAuth"
        [ -n "$sans" ] && echo "subjectAltName=$sans"
    } > "$ext"
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$PKI/$name.key" \
        -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
    openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
        -days 30 -extfile "$ext" -out "$PKI/$name.crt" 2>/dev/null
    rm -f "$ext" "$PKI/$name.csr"
}

# kubeconfig FILE USER: a client-certificate kubeconfig for the certificate named USER.
kubeconfig() {
    cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: $CLUSTER_NAME
  cluster:
    server: https://$NODE_IP:6443
    certificate-authority-data: $(base64 -w0 "$PKI/ca.crt")
users:
- name: $2
  user:
    client-certificate-data: $(base64 -w0 "$PKI/$2.crt")
    client-key-data: $(base64 -w0 "$PKI/$2.key")
contexts:
- name: $CLUSTER_NAME
  context: {cluster: $CLUSTER_NAME, user: $2}
current-context: $CLUSTER_NAME
EOF
}

make_pki() {
    PKI="$STATE/pki"
    mkdir -p "$PKI"
    # ECDSA P-256 throughout: RSA key generation alone took 20 s on a loaded 2-core machine.
    openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$PKI/ca.key" -subj "/CN=$CLUSTER_NAME-ca" \
        -days 30 -out "$PKI/ca.crt" 2>/dev/null
    cert apiserver kube-apiserver "" \
        "IP:$NODE_IP,IP:$API_SERVICE_IP,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.$DOMAIN,DNS:localhost"
    cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
    cert admin kubernetes-admin system:masters
    cert controller-manager system:kube-controller-manager
    cert scheduler system:kube-scheduler
    cert kube-proxy system:kube-proxy
    cert kubelet "system:node:$NODE" system:nodes
    cert kubelet-serving "$NODE" "" "IP:$NODE_IP,DNS:$NODE"
    openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/sa.key" 2>/dev/null
    openssl ec -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
    kubeconfig "$STATE/kubeconfig" admin
    for who in controller-manager scheduler kube-proxy kubelet; do
        kubeconfig "$STATE/$who.kubeconfig" "$who"
    done
}

# --- the node's network -----------------------------------------------------------------------

make_netns() {
    ip netns add "$NS"
    ip link add "$HOST_VETH" type veth peer name "$NS-0"
    ip link set "$NS-0" netns "$NS"
    ip addr add "$HOST_IP/30" dev "$HOST_VETH"
    ip link set "$HOST_VETH" up
    in_node ip link set lo up
    in_node ip link set "$NS-0" name eth0
    in_node ip addr add "$NODE_IP/30" dev eth0
    in_node ip link set eth0 up
    # No default route: nothing leaves. The Service range needs a route so that a connection
    # from the node itself reaches the NAT rules kube-proxy writes.
    in_node ip route add "$SERVICE_CIDR" dev eth0
    in_node sysctl -qw net.ipv4.ip_forward=1
}

# --- processes --------------------------------------------------------------------------------

# start NAME CMD...: a daemon in the node's network namespace (the host's mount namespace, so
# that the kubelet's volume mounts are the ones containerd sees), its own session, a log file.
start() {
    local name=$1
    shift
    setsid nsenter --net="/run/netns/$NS" "$@" >"$STATE/logs/$name.log" 2>&1 </dev/null &
    echo $! > "$STATE/pids/$name"
}

# wait_until SECONDS WHAT CMD...: polls CMD until it succeeds.
wait_until() {
    local limit=$1 what=$2 start=$SECONDS
    shift 2
    until "$@" >/dev/null 2>&1; do
        if [ $((SECONDS - start)) -ge "$limit" ]; then
            log "timed out after ${limit} s waiting for $what; the logs are in $STATE/logs"
            tail -n 20 "$STATE"/logs/*.log >&2 || true
            return 1
        fi
        sleep 0.5
    done
    log "$what after $((SECONDS - start)) s"
}

start_control_plane() {
    start etcd "$BIN/etcd" --name "$NODE" --data-dir "$STATE/etcd" \
        --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
        --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
        --initial-cluster "$NODE=http://127.0.0.1:2380" --unsafe-no-fsync --log-level warn
    start kube-apiserver "$BIN/kube-apiserver" \
        --advertise-address "$NODE_IP" --secure-port 6443 --etcd-servers http://127.0.0.1:2379 \
        --service-cluster-ip-range "$SERVICE_CIDR" --allow-privileged=true \
        --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
        --client-ca-file "$PKI/ca.crt" --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
        --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
        --kubelet-preferred-address-types InternalIP \
        --service-account-issuer "https://kubernetes.default.svc.$DOMAIN" \
        --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
        --profiling=false --v 1 --request-timeout 5m
    # (--request-timeout: 60 s by default. A bare CI run started this cluster beside the swarm
    # tier, right after importing the image, and the API server timed out creating the CRDs,
    # node leases included, for two minutes: every test of the tier failed at helm install.)
    wait_until 60 "API server ready" kubectl_ get --raw /readyz
    start kube-controller-manager "$BIN/kube-controller-manager" \
        --kubeconfig "$STATE/controller-manager.kubeconfig" \
        --authentication-kubeconfig "$STATE/controller-manager.kubeconfig" \
        --authorization-kubeconfig "$STATE/controller-manager.kubeconfig" \
        --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
        --use-service-account-credentials=true --cluster-name "$CLUSTER_NAME" \
        --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
        --leader-elect=false --bind-address 127.0.0.1 --profiling=false
    start kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$STATE/scheduler.kubeconfig" \
        --authentication-kubeconfig "$STATE/scheduler.kubeconfig" --authorization-kubeconfig "$STATE/scheduler.kubeconfig" \
        --leader-elect=false --bind-address 127.0.0.1 --profiling=false
}

start_containerd() {
    mkdir -p "$STATE/containerd" "$STATE/cni" "$RUN"
    cat > "$STATE/containerd/config.toml" <<EOF
version = 2
root = "$CONTAINERD_ROOT"
state = "$RUN/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]
[grpc]
  address = "$RUN/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # runc cannot raise its own oom_score_adj in these VMs (no CAP_SYS_RESOURCE).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni"
EOF
    # One point-to-point link per pod (CNI ptp): every packet between pods crosses the node's
    # routing and kube-proxy's rules, which a bridge would need br_netfilter for.
    cat > "$STATE/cni/10-hivekeeper.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "hivekeeper-pods", "plugins": [
  {"type": "ptp", "mtu": 1500,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]],
            "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$STATE/cni-ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}
]}
EOF
    start containerd containerd --config "$STATE/containerd/config.toml"
    wait_until 30 "containerd ready" ctr_ version
}

# import_image REF ARCHIVE: into the node's containerd, unless this very archive (its key, a hash
# of what the image is made of) was the last one imported under REF.
import_image() {
    local stamp
    stamp="$CONTAINERD_ROOT/imported/$(tr '/:' '__' <<<"$1")"
    local names
    names="$(ctr_ images ls -q)"
    if [ -f "$stamp" ] && cmp -s "$stamp" "$2.key" && grep -qx "$1" <<<"$names"; then
        log "$1: already imported"
        return
    fi
    if ! ctr_ images import "$2" >/dev/null; then
        # The cached snapshots can lose a parent (an interrupted unpack or garbage collection
        # between runs): "parent snapshot ... does not exist". Start the cache's images over.
        log "$1: import failed; clearing cached images and snapshots, then importing again"
        clear_image_cache
        ctr_ images import "$2" >/dev/null || die "importing $2 failed twice"
    fi
    names="$(ctr_ images ls -q)"
    grep -qx "$1" <<<"$names" || die "importing $2 did not name $1"
    mkdir -p "$(dirname "$stamp")"
    cp "$2.key" "$stamp"
}

# clear_image_cache: every image and snapshot of the node's containerd (no container runs yet).
clear_image_cache() {
    local ref snapshot left before
    for ref in $(ctr_ images ls -q); do ctr_ images rm "$ref" >/dev/null || true; done
    rm -rf "$CONTAINERD_ROOT/imported"
    left="$(ctr_ snapshots ls | awk 'NR > 1 {print $1}')"
    while [ -n "$left" ]; do  # children before their parents: remove what can go until none is left
        before="$left"
        for snapshot in $left; do ctr_ snapshots rm "$snapshot" >/dev/null 2>&1 || true; done
        left="$(ctr_ snapshots ls | awk 'NR > 1 {print $1}')"
        [ "$left" != "$before" ] || die "cannot clear containerd's snapshots in $CONTAINERD_ROOT: remove it by hand"
    done
}

import_images() {
    local start=$SECONDS
    import_image "$IMAGE" "$ARCHIVE"
    import_image "$PAUSE_IMAGE" "$PAUSE_ARCHIVE"  # second: small, and cleared with the rest if the first cleared the cache
    local names
    names="$(ctr_ images ls -q)"  # (not piped into grep -q: with pipefail, its early exit fails the pipe)
    grep -qx "$IMAGE" <<<"$names" || die "$IMAGE went missing while importing $PAUSE_IMAGE: run up again"
    log "images ready in $((SECONDS - start)) s: $IMAGE, $PAUSE_IMAGE"
}

start_node() {
    mkdir -p "$STATE/kubelet"
    local sysctl
    : > "$STATE/sysctls"
    for sysctl in "${KUBELET_SYSCTLS[@]}"; do
        [ -r "/proc/sys/$sysctl" ] && echo "$sysctl $(cat "/proc/sys/$sysctl")" >> "$STATE/sysctls"
    done
    echo "nameserver $NODE_IP" > "$STATE/resolv.conf"
    make_cgroup_root
    cat > "$STATE/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
cgroupRoot: $CGROUP_ROOT
# Each lab's kubelet removes the log folders of pods it does not know: one folder per lab.
podLogsDir: $STATE/pod-logs
containerRuntimeEndpoint: unix://$RUN/containerd.sock
clusterDNS: [$NODE_IP]
clusterDomain: $DOMAIN
resolvConf: $STATE/resolv.conf
tlsCertFile: $PKI/kubelet-serving.crt
tlsPrivateKeyFile: $PKI/kubelet-serving.key
failSwapOn: false
address: $NODE_IP
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
# The disk is shared with everything else on this machine: evict only when it is really full.
evictionHard: {memory.available: 200Mi, nodefs.available: 2%, imagefs.available: 2%, nodefs.inodesFree: 2%}
imageGCHighThresholdPercent: 100
serializeImagePulls: false
EOF
    start kubelet "$BIN/kubelet" --config "$STATE/kubelet/config.yaml" --kubeconfig "$STATE/kubelet.kubeconfig" \
        --root-dir "$STATE/kubelet/root" --cert-dir "$STATE/kubelet/pki" \
        --hostname-override "$NODE" --node-ip "$NODE_IP" --v 1
    cat > "$STATE/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $STATE/kube-proxy.kubeconfig}
mode: iptables
clusterCIDR: $POD_CIDR
hostnameOverride: $NODE
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# Leave the host's conntrack table as it is (a global setting, not the namespace's).
conntrack: {maxPerCore: 0, min: 0}
EOF
    start kube-proxy "$BIN/kube-proxy" --config "$STATE/kube-proxy.yaml"
    # CoreDNS serves the cluster's names from the API, on the node's address.
    cat > "$STATE/Corefile" <<EOF
.:53 {
    errors
    health 127.0.0.1:8080
    ready 127.0.0.1:8181
    kubernetes $DOMAIN in-addr.arpa ip6.arpa {
        kubeconfig $STATE/kubeconfig
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
}
EOF
    start coredns "$BIN/coredns" -conf "$STATE/Corefile" -dns.port 53
    wait_until 120 "node $NODE Ready" node_ready
    wait_until 30 "CoreDNS ready" in_node curl -sf http://127.0.0.1:8181/ready
    # A namespace takes pods only once its default ServiceAccount exists.
    wait_until 60 "the default ServiceAccount" kubectl_ get serviceaccount default
}

# make_cgroup_root: lab b's kubelet puts its pods under a cgroup of its own (the kubelet needs it
# to exist), so that two kubelets on one machine never manage each other's pods. cpuset needs
# its CPUs and memory nodes set before anything can run in it: the root's.
make_cgroup_root() {
    [ "$CGROUP_ROOT" = / ] && return
    local hierarchy
    for hierarchy in /sys/fs/cgroup/*/; do
        [ -L "${hierarchy%/}" ] && continue  # cpu,cpuacct's aliases
        mkdir -p "$hierarchy${CGROUP_ROOT#/}"
    done
    if [ -d /sys/fs/cgroup/cpuset ]; then
        cat /sys/fs/cgroup/cpuset/cpuset.cpus > "/sys/fs/cgroup/cpuset$CGROUP_ROOT/cpuset.cpus"
        cat /sys/fs/cgroup/cpuset/cpuset.mems > "/sys/fs/cgroup/cpuset$CGROUP_ROOT/cpuset.mems"
    fi
}

node_ready() {
    [ "$(kubectl_ get node "$NODE" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" = True ]
}

load_image_names() {
    local env_file="$CACHE/image/archives/images.env"
    [ -f "$env_file" ] || die "no image built: $env_file is missing (scripts/cluster.sh build)"
    # shellcheck disable=SC1090
    . "$env_file"
    [ -n "${IMAGE:-}" ] && [ -n "${ARCHIVE:-}" ] && [ -n "${PAUSE_IMAGE:-}" ] && [ -n "${PAUSE_ARCHIVE:-}" ] \
        || die "$env_file names no images"
}

cmd_up() {
    local start=$SECONDS
    [ -x "$KUBECTL" ] || "$ROOT/scripts/get-helm.sh" >/dev/null
    if [ -e "/run/netns/$NS" ]; then
        log "a cluster is already up (or was left behind): taking it down first"
        cmd_down
    fi
    cmd_build
    load_image_names
    log "starting Kubernetes v$K8S_VERSION"
    local up_start=$SECONDS
    rm -rf "$STATE"
    mkdir -p "$STATE/logs" "$STATE/pids"
    make_pki
    make_netns
    start_control_plane
    start_containerd
    import_images
    start_node
    {
        echo "KUBECONFIG=$STATE/kubeconfig"
        echo "HIVEKEEPER_E2E_IMAGE=$IMAGE"
        echo "HIVEKEEPER_KUBECTL=$KUBECTL"
        echo "HIVEKEEPER_E2E_PUBLIC_IP=$PUBLIC_IP"
    } > "$STATE/env"
    log "cluster up in $((SECONDS - up_start)) s ($((SECONDS - start)) s with the build): KUBECONFIG=$STATE/kubeconfig"
}

# --- down -------------------------------------------------------------------------------------

stop_pid() {  # stop_pid NAME: SIGTERM, then SIGKILL after 10 s
    local file="$STATE/pids/$1" pid i
    [ -f "$file" ] || return 0
    pid="$(cat "$file")"
    if kill -TERM "$pid" 2>/dev/null; then
        for i in $(seq 1 40); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.25
        done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

# Every process in a pod: those whose cgroup is under the kubelet's kubepods, and the shims.
kill_pods() {
    local pids pid
    pids="$(grep -l ":$(kubepods)/" /proc/[0-9]*/cgroup 2>/dev/null | cut -d/ -f3 || true)"
    pids+=" $(pgrep -f "containerd-shim-runc-v2 .*-address $RUN/" || true)"
    for pid in $pids; do kill -KILL "$pid" 2>/dev/null || true; done
    for pid in $pids; do
        while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    done
}

# The pods' containers and sandboxes go with the cluster; the images stay in containerd's root.
remove_containers() {
    [ -S "$RUN/containerd.sock" ] || return 0
    local ids
    ids="$(ctr_ containers ls -q 2>/dev/null || true)"
    # shellcheck disable=SC2086
    [ -n "$ids" ] && ctr_ containers rm $ids >/dev/null 2>&1 || true
}

unmount_under() {  # unmount everything mounted under each directory given, deepest first
    local dir mounts
    for dir in "$@"; do
        [ -e "$dir" ] || continue
        mounts="$(awk -v d="$dir" '$5 == d || index($5, d "/") == 1 {print $5}' /proc/self/mountinfo | sort -r)"
        for m in $mounts; do umount -l "$m" 2>/dev/null || true; done
    done
}

cmd_down() {
    for name in kubelet kube-proxy coredns kube-scheduler kube-controller-manager; do stop_pid "$name"; done
    kill_pods
    remove_containers
    stop_pid containerd
    kill_pods
    stop_pid kube-apiserver
    stop_pid etcd
    unmount_under "$STATE" "$RUN" "$CONTAINERD_ROOT"
    rm -rf "$CONTAINERD_ROOT/io.containerd.grpc.v1.cri/containers" "$CONTAINERD_ROOT/io.containerd.grpc.v1.cri/sandboxes"
    # The pods' network namespaces (containerd's CNI names them cni-<uuid>): those no process is
    # in any more, now that this lab's pods are gone (the other lab's pods are still in theirs).
    for netns in /run/netns/cni-*; do
        [ -e "$netns" ] || continue
        [ -z "$(ip netns pids "$(basename "$netns")" 2>/dev/null)" ] || continue
        umount -l "$netns" 2>/dev/null || true
        rm -f "$netns"
    done
    # The kubelet's cgroups (empty now that their processes are gone).
    find /sys/fs/cgroup/*"$(kubepods)" -depth -type d -exec rmdir {} + 2>/dev/null || true
    [ "$CGROUP_ROOT" = / ] || rmdir /sys/fs/cgroup/*"$CGROUP_ROOT" 2>/dev/null || true
    ip netns del "$NS" 2>/dev/null || true
    ip link del "$HOST_VETH" 2>/dev/null || true
    if [ -f "$STATE/sysctls" ]; then
        while read -r key value; do echo "$value" > "/proc/sys/$key" 2>/dev/null || true; done < "$STATE/sysctls"
        rm -f "$STATE/sysctls"
    fi
    rm -rf "$RUN"
    log "cluster down"
}

# --- the WAN between the labs ---------------------------------------------------------------

# wan_link LAB: a veth from the WAN namespace to LAB's node: the node's public address on its
# end (wan0), a route to the other public addresses through the WAN, its pods masqueraded
# behind that address; the delay and the rate cap on the WAN's end, the way packets leave it
# toward the node (so each direction of a path between the nodes crosses one of each).
wan_link() {
    lab "$1"
    [ -e "/run/netns/$NS" ] || die "lab $LAB's cluster is not up (scripts/cluster.sh up $LAB)"
    local wan_end="wan-$LAB"
    ip link add "$wan_end" netns "$WAN_NS" type veth peer name wan0 netns "$NS"
    ip -n "$WAN_NS" addr add "$WAN_GATEWAY/30" dev "$wan_end"
    ip -n "$WAN_NS" link set "$wan_end" up
    # the cap's queue holds two round trips at the cap (at least 128 KiB), its burst 5 ms (at
    # least a 64 KiB GSO packet): as tests/netns.py shapes its WAN
    local rate=$((WAN_RATE_MBIT * 125000))
    local burst=$((rate / 200 > 65536 ? rate / 200 : 65536)) limit=$((rate * 8 / 100 > 131072 ? rate * 8 / 100 : 131072))
    ip netns exec "$WAN_NS" tc qdisc add dev "$wan_end" root tbf rate "${WAN_RATE_MBIT}mbit" burst "$burst" limit "$limit"
    in_node ip addr add "$PUBLIC_IP/30" dev wan0
    in_node ip link set wan0 up
    in_node ip route add 203.0.113.0/24 via "$WAN_GATEWAY" dev wan0
    in_node iptables -w -t nat -A POSTROUTING -s "$POD_CIDR" -o wan0 -j MASQUERADE
    # the host reaches the public address through its veth into the node
    ip route replace "$PUBLIC_IP/32" via "$NODE_IP" dev "$HOST_VETH"
}

cmd_wan() {
    case "${1:-}" in
        up)
            cmd_wan_down
            ip netns add "$WAN_NS"
            ip -n "$WAN_NS" link set lo up
            ip netns exec "$WAN_NS" sysctl -qw net.ipv4.ip_forward=1
            wan_link a
            wan_link b
            start_delay_line 20ms
            log "WAN up: lab a at 203.0.113.2, lab b at 203.0.113.6, 40 ms round trip, ${WAN_RATE_MBIT} Mbit/s"
            ;;
        down) cmd_wan_down ;;
        *) die "usage: $0 wan up | wan down" ;;
    esac
}

# start_delay_line DELAY: bench/wandelay in the WAN namespace, holding each packet it forwards
# for DELAY (built with this machine's Go, cached by its source's digest as tests/netns.py does).
start_delay_line() {
    local digest binary
    digest="$(cat "$ROOT"/bench/wandelay/*.go | sha256sum | cut -c1-16)"
    binary="$CACHE/wandelay-$digest"
    if [ ! -x "$binary" ]; then
        (cd "$ROOT/bench/wandelay" && CGO_ENABLED=0 go build -o "$binary.tmp" .) && mv "$binary.tmp" "$binary" \
            || die "building bench/wandelay failed"
    fi
    mkdir -p "$WAN_RUN"
    setsid ip netns exec "$WAN_NS" "$binary" -queue 0 -delay "$1" >"$WAN_RUN/wandelay.log" 2>&1 </dev/null &
    echo $! > "$WAN_RUN/pid"
    local i
    for i in $(seq 1 100); do  # it prints "ready" once bound to its queue
        grep -qx ready "$WAN_RUN/wandelay.log" && break
        kill -0 "$(cat "$WAN_RUN/pid")" 2>/dev/null && [ "$i" -lt 100 ] \
            || die "wandelay did not start: $(cat "$WAN_RUN/wandelay.log")"
        sleep 0.1
    done
    ip netns exec "$WAN_NS" iptables -w -A FORWARD -j NFQUEUE --queue-num 0
}

# cmd_wan_down: the WAN namespace (its veths go with it) and what the labs' nodes and the host
# hold for it.
cmd_wan_down() {
    local l
    for l in a b; do
        lab "$l"
        ip route del "$PUBLIC_IP/32" 2>/dev/null || true
        [ -e "/run/netns/$NS" ] || continue
        in_node iptables -w -t nat -D POSTROUTING -s "$POD_CIDR" -o wan0 -j MASQUERADE 2>/dev/null || true
    done
    if [ -f "$WAN_RUN/pid" ]; then
        kill "$(cat "$WAN_RUN/pid")" 2>/dev/null || true
    fi
    rm -rf "$WAN_RUN"
    ip netns del "$WAN_NS" 2>/dev/null || true
}

cmd_labs() {
    case "${1:-}" in
        up) (lab a; cmd_up) && (lab b; cmd_up) && cmd_wan up ;;
        down) cmd_wan_down; (lab b; cmd_down); (lab a; cmd_down) ;;
        *) die "usage: $0 labs up | labs down" ;;
    esac
}

cmd_env() { cat "$STATE/env"; }

cmd_load() {
    [ -S "$RUN/containerd.sock" ] || die "no cluster is up (scripts/cluster.sh up)"
    cmd_images
    load_image_names
    import_images
}

command=${1:-}
shift || true
case "$command" in
    build) cmd_build ;;
    binaries) cmd_binaries ;;
    images) cmd_images ;;
    up) lab "${1:-a}"; cmd_up ;;
    down) lab "${1:-a}"; cmd_down ;;
    env) lab "${1:-a}"; cmd_env ;;
    load) lab "${1:-a}"; cmd_load ;;
    wan) cmd_wan "$@" ;;
    labs) cmd_labs "$@" ;;
    *) echo "usage: $0 build|binaries|images|up [b]|down [b]|load [b]|env [b]|wan up|wan down|labs up|labs down" >&2
       exit 2 ;;
esac
