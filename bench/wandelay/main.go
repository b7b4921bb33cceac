// wandelay holds every packet netfilter queues to it (iptables ... -j NFQUEUE) for a fixed
// delay, then lets it go on: the propagation delay of a WAN, where the kernel has no netem.
// Packets leave in the order they came, each one `-delay` after it arrived; a rate cap
// (tc tbf on the link out) then queues them as a bottleneck link would.
//
// It speaks nfnetlink_queue directly (the standard library only): it binds the queue with
// metadata-only copies (a packet's content never leaves the kernel), fail-open (a full queue
// passes packets on rather than dropping them) and GSO packets unsegmented, and it accepts
// every packet due with one batch verdict (NFQNL_MSG_VERDICT_BATCH: ids up to N).
//
//	wandelay -queue 0 -delay 20ms
//
// It prints "ready" once bound, and runs until SIGTERM or SIGINT.
package main

import (
	"encoding/binary"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"
)

const (
	nfnlSubsysQueue = 3
	msgPacket       = 0
	msgConfig       = 2
	msgVerdictBatch = 3

	cfgCmd       = 1
	cfgParams    = 2
	cfgMaxLen    = 3
	cfgMask      = 4
	cfgFlags     = 5
	cmdBind      = 1
	copyMeta     = 1
	flagFailOpen = 1
	flagGSO      = 4

	attrPacketHdr  = 1
	attrVerdictHdr = 2
	nfAccept       = 1

	nlmFRequest = 1
	nlmFAck     = 4
	nlmsgError  = 2
)

type held struct {
	id  uint32
	due time.Time
}

func main() {
	queue := flag.Uint("queue", 0, "the NFQUEUE number to serve")
	delay := flag.Duration("delay", 20*time.Millisecond, "how long each packet is held")
	maxLen := flag.Uint("max-len", 1<<16, "packets the kernel may queue before it passes them on (fail-open)")
	flag.Parse()
	if err := run(uint16(*queue), *delay, uint32(*maxLen)); err != nil {
		fmt.Fprintln(os.Stderr, "wandelay:", err)
		os.Exit(1)
	}
}

func run(queue uint16, delay time.Duration, maxLen uint32) error {
	fd, err := syscall.Socket(syscall.AF_NETLINK, syscall.SOCK_RAW, syscall.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("netlink socket: %w", err)
	}
	_ = syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, 33 /* SO_RCVBUFFORCE */, 64<<20)
	if err := syscall.Bind(fd, &syscall.SockaddrNetlink{Family: syscall.AF_NETLINK}); err != nil {
		return fmt.Errorf("netlink bind: %w", err)
	}
	cmd := []byte{cmdBind, 0, 0, 0} // pf is ignored by kernels since 3.8
	params := make([]byte, 5)
	binary.BigEndian.PutUint32(params, 0)
	params[4] = copyMeta
	flags := be32(flagFailOpen | flagGSO)
	for i, attrs := range [][]attr{
		{{cfgCmd, cmd}},
		{{cfgParams, params}, {cfgMaxLen, be32(maxLen)}, {cfgMask, flags}, {cfgFlags, flags}},
	} {
		if err := request(fd, msgConfig, queue, uint32(i+1), attrs); err != nil {
			return fmt.Errorf("binding queue %d: %w", queue, err)
		}
	}
	fmt.Println("ready")

	var mu sync.Mutex
	var pending []held
	go release(fd, queue, &mu, &pending)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() { <-stop; os.Exit(0) }()

	buf := make([]byte, 1<<20)
	for {
		n, _, err := syscall.Recvfrom(fd, buf, 0)
		if err == syscall.ENOBUFS { // notifications lost; their packets go with a later batch verdict
			continue
		}
		if err != nil {
			return fmt.Errorf("recv: %w", err)
		}
		now := time.Now()
		for _, id := range packetIDs(buf[:n]) {
			mu.Lock()
			pending = append(pending, held{id, now.Add(delay)})
			mu.Unlock()
		}
	}
}

// release accepts, every fraction of a millisecond, every packet whose time has come.
func release(fd int, queue uint16, mu *sync.Mutex, pending *[]held) {
	var seq uint32 = 100
	for {
		time.Sleep(200 * time.Microsecond)
		now := time.Now()
		mu.Lock()
		due := 0
		for due < len(*pending) && !(*pending)[due].due.After(now) {
			due++
		}
		var last uint32
		if due > 0 {
			last = (*pending)[due-1].id
			*pending = (*pending)[due:]
		}
		mu.Unlock()
		if due == 0 {
			continue
		}
		verdict := make([]byte, 8)
		binary.BigEndian.PutUint32(verdict, nfAccept)
		binary.BigEndian.PutUint32(verdict[4:], last)
		seq++
		if err := send(fd, msgVerdictBatch, queue, seq, 0, []attr{{attrVerdictHdr, verdict}}); err != nil {
			fmt.Fprintln(os.Stderr, "wandelay: verdict:", err)
		}
	}
}

type attr struct {
	kind uint16
	data []byte
}

func be32(v uint32) []byte {
	b := make([]byte, 4)
	binary.BigEndian.PutUint32(b, v)
	return b
}

func message(kind uint16, queue uint16, seq uint32, flags uint16, attrs []attr) []byte {
	body := []byte{syscall.AF_UNSPEC, 0, byte(queue >> 8), byte(queue)} // nfgenmsg: family, version, res_id (BE)
	for _, a := range attrs {
		length := 4 + len(a.data)
		head := make([]byte, 4)
		binary.LittleEndian.PutUint16(head, uint16(length))
		binary.LittleEndian.PutUint16(head[2:], a.kind)
		body = append(body, head...)
		body = append(body, a.data...)
		for len(body)%4 != 0 {
			body = append(body, 0)
		}
	}
	out := make([]byte, 16, 16+len(body))
	binary.LittleEndian.PutUint32(out, uint32(16+len(body)))
	binary.LittleEndian.PutUint16(out[4:], nfnlSubsysQueue<<8|kind)
	binary.LittleEndian.PutUint16(out[6:], nlmFRequest|flags)
	binary.LittleEndian.PutUint32(out[8:], seq)
	return append(out, body...)
}

func send(fd int, kind uint16, queue uint16, seq uint32, flags uint16, attrs []attr) error {
	return syscall.Sendto(fd, message(kind, queue, seq, flags, attrs), 0, &syscall.SockaddrNetlink{Family: syscall.AF_NETLINK})
}

// request sends a message that the kernel acknowledges, and returns its error if any.
func request(fd int, kind uint16, queue uint16, seq uint32, attrs []attr) error {
	if err := send(fd, kind, queue, seq, nlmFAck, attrs); err != nil {
		return err
	}
	buf := make([]byte, 8192)
	for {
		n, _, err := syscall.Recvfrom(fd, buf, 0)
		if err != nil {
			return err
		}
		for off := 0; off+16 <= n; {
			length := int(binary.LittleEndian.Uint32(buf[off:]))
			if length < 16 || off+length > n {
				break
			}
			if binary.LittleEndian.Uint16(buf[off+4:]) == nlmsgError && binary.LittleEndian.Uint32(buf[off+8:]) == seq {
				if code := int32(binary.LittleEndian.Uint32(buf[off+16:])); code != 0 {
					return syscall.Errno(-code)
				}
				return nil
			}
			off += (length + 3) &^ 3
		}
	}
}

// packetIDs reads the packet ids of the NFQNL_MSG_PACKET messages in one datagram.
func packetIDs(data []byte) []uint32 {
	var ids []uint32
	for off := 0; off+16 <= len(data); {
		length := int(binary.LittleEndian.Uint32(data[off:]))
		if length < 16 || off+length > len(data) {
			break
		}
		kind := binary.LittleEndian.Uint16(data[off+4:])
		if kind == nfnlSubsysQueue<<8|msgPacket {
			for a := off + 20; a+4 <= off+length; {
				alen := int(binary.LittleEndian.Uint16(data[a:]))
				if alen < 4 {
					break
				}
				if binary.LittleEndian.Uint16(data[a+2:])&0x7fff == attrPacketHdr && alen >= 8 {
					ids = append(ids, binary.BigEndian.Uint32(data[a+4:]))
				}
				a += (alen + 3) &^ 3
			}
		}
		off += (length + 3) &^ 3
	}
	return ids
}
