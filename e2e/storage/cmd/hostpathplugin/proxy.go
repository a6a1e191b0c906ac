package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"k8s.io/klog/v2"
)

// proxy does what `socat UNIX-LISTEN:<endpoint>,fork TCP-LISTEN:<port>,reuseport` would do for
// the e2e tests (test/e2e/storage/drivers/proxy/portproxy.go): the gRPC *server* is the e2e
// test process outside the cluster, which cannot dial into the pod. It instead keeps a few
// connections open to the TCP port through port forwarding, and each client on the CSI socket
// (kubelet, sidecars) is paired with one of them. Unlike socat, both ports listen all the
// time, so the test process can connect before any client exists.
type proxy struct {
	unixL, tcpL net.Listener
	// tcpConns holds accepted TCP connections that no unix client has claimed yet.
	tcpConns chan net.Conn
}

// maxQueued bounds the TCP connections accepted ahead of clients; further ones wait in the
// kernel's backlog. The e2e side opens at most 10.
const maxQueued = 16

func newProxy(unixEndpoint, tcpEndpoint string) (*proxy, error) {
	if network, _, err := parseEndpoint(unixEndpoint); err != nil {
		return nil, err
	} else if network != "unix" {
		return nil, fmt.Errorf("--endpoint %q must be a unix socket in proxy mode", unixEndpoint)
	}
	unixL, err := listen(unixEndpoint)
	if err != nil {
		return nil, err
	}
	tcpL, err := listen(tcpEndpoint)
	if err != nil {
		unixL.Close()
		return nil, err
	}
	klog.V(3).InfoS("Proxy listening", "endpoint", unixL.Addr().String(), "proxyEndpoint", tcpL.Addr().String())
	return &proxy{unixL: unixL, tcpL: tcpL, tcpConns: make(chan net.Conn, maxQueued)}, nil
}

// run pairs connections until ctx is done. Unix clients are served in the order they
// connect, each with the oldest waiting TCP connection, or the next one to arrive.
func (p *proxy) run(ctx context.Context) error {
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wg.Add(2)
	go func() {
		defer wg.Done()
		<-ctx.Done()
		p.unixL.Close() // also removes the socket file
		p.tcpL.Close()
	}()
	go func() {
		defer wg.Done()
		p.acceptTCP(ctx)
	}()

	for {
		client, err := p.unixL.Accept()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			// Transient (e.g. out of file descriptors): keep serving, as upstream does.
			klog.ErrorS(err, "Proxy accept failed", "endpoint", p.unixL.Addr().String())
			time.Sleep(100 * time.Millisecond)
			continue
		}
		klog.V(5).InfoS("Proxy accepted a client, waiting for a TCP connection")
		select {
		case server := <-p.tcpConns:
			klog.V(3).InfoS("Proxy established a new connection", "tcpPeer", server.RemoteAddr().String())
			go pipe(client, server)
		case <-ctx.Done():
			client.Close()
			return nil
		}
	}
}

func (p *proxy) acceptTCP(ctx context.Context) {
	defer func() {
		// Nobody will claim queued connections any more.
		for {
			select {
			case c := <-p.tcpConns:
				c.Close()
			default:
				return
			}
		}
	}()
	for {
		c, err := p.tcpL.Accept()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			klog.ErrorS(err, "Proxy accept failed", "endpoint", p.tcpL.Addr().String())
			time.Sleep(100 * time.Millisecond)
			continue
		}
		klog.V(5).InfoS("Proxy accepted a TCP connection", "tcpPeer", c.RemoteAddr().String())
		select {
		case p.tcpConns <- c:
		case <-ctx.Done():
			c.Close()
			return
		}
	}
}

// pipe copies both ways; when either side ends, both connections are closed so that the
// other peer notices, as with socat.
func pipe(a, b net.Conn) {
	var once sync.Once
	closeBoth := func() { a.Close(); b.Close() }
	copyTo := func(dst, src net.Conn, direction string) {
		n, err := io.Copy(dst, src)
		klog.V(5).InfoS("Proxy stopped copying", "direction", direction, "bytes", n, "err", err)
		once.Do(closeBoth)
	}
	go copyTo(b, a, "unix->tcp")
	copyTo(a, b, "tcp->unix")
}
