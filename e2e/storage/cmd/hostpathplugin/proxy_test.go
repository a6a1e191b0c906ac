package main

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/peer"
)

// e2eIdentity plays the e2e test process's embedded driver and records which TCP connection
// each call arrived on.
type e2eIdentity struct {
	csi.UnimplementedIdentityServer
	mu    sync.Mutex
	peers []string
}

func (s *e2eIdentity) GetPluginInfo(ctx context.Context, _ *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	p, _ := peer.FromContext(ctx)
	s.mu.Lock()
	s.peers = append(s.peers, p.Addr.String())
	s.mu.Unlock()
	return &csi.GetPluginInfoResponse{Name: "embedded.csi.example.com", VendorVersion: "0.3.0"}, nil
}

// connListener hands the gRPC server connections the test dialled to the proxy's TCP port,
// as portproxy.go's listener hands out port-forwarded streams.
type connListener struct {
	conns     chan net.Conn
	closed    chan struct{}
	closeOnce sync.Once
}

func (l *connListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	}
}

func (l *connListener) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return nil
}

func (l *connListener) Addr() net.Addr { return label("e2e") }

type label string

func (l label) Network() string { return "test" }
func (l label) String() string  { return string(l) }

// labelledConn names a TCP connection so that the server can tell them apart (all of them
// have the same remote address, the proxy's port).
type labelledConn struct {
	net.Conn
	name label
}

func (c labelledConn) RemoteAddr() net.Addr { return c.name }

func TestProxyMode(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "csi.sock")
	p, err := newProxy(socket, "tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- p.run(ctx) }()
	defer cancel()
	tcpAddr := p.tcpL.Addr().String()

	// The e2e side: a gRPC server on connections it opened to the proxy.
	l := &connListener{conns: make(chan net.Conn), closed: make(chan struct{})}
	ids := &e2eIdentity{}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, ids)
	go srv.Serve(l)
	defer srv.Stop()
	connectE2E := func(name string) {
		c, err := net.Dial("tcp", tcpAddr)
		if err != nil {
			t.Fatal(err)
		}
		l.conns <- labelledConn{Conn: c, name: label(name)}
	}
	getInfo := func(conn *grpc.ClientConn) (*csi.GetPluginInfoResponse, error) {
		callCtx, callCancel := context.WithTimeout(ctx, 10*time.Second)
		defer callCancel()
		return csi.NewIdentityClient(conn).GetPluginInfo(callCtx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true))
	}

	// A client that connects before any TCP connection exists waits for the next one.
	type result struct {
		resp *csi.GetPluginInfoResponse
		err  error
	}
	first := make(chan result, 1)
	firstConn := dialUnix(t, socket)
	go func() {
		resp, err := getInfo(firstConn)
		first <- result{resp, err}
	}()
	select {
	case r := <-first:
		t.Fatalf("call completed without a TCP connection: %v, %v", r.resp, r.err)
	case <-time.After(300 * time.Millisecond):
	}
	connectE2E("tcp-1")
	if r := <-first; r.err != nil || r.resp.GetName() != "embedded.csi.example.com" {
		t.Fatalf("GetPluginInfo through proxy = %v, %v", r.resp, r.err)
	}

	// A TCP connection that arrives first is kept until a client comes.
	connectE2E("tcp-2")
	time.Sleep(100 * time.Millisecond)
	if resp, err := getInfo(dialUnix(t, socket)); err != nil || resp.GetName() != "embedded.csi.example.com" {
		t.Fatalf("second GetPluginInfo through proxy = %v, %v", resp, err)
	}

	// Two clients, two paired connections.
	ids.mu.Lock()
	peers := append([]string(nil), ids.peers...)
	ids.mu.Unlock()
	sort.Strings(peers)
	if len(peers) != 2 || peers[0] != "tcp-1" || peers[1] != "tcp-2" {
		t.Fatalf("calls arrived on connections %q, want one each on tcp-1 and tcp-2", peers)
	}

	cancel()
	select {
	case err := <-ran:
		if err != nil {
			t.Fatalf("proxy run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("proxy did not stop")
	}
	if _, err := os.Stat(socket); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket still there after shutdown: %v", err)
	}
}

func TestProxyRejectsTCPEndpoint(t *testing.T) {
	if _, err := newProxy("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"); err == nil {
		t.Fatal("newProxy accepted a TCP --endpoint")
	}
}
