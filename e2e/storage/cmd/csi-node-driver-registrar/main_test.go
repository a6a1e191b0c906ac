package main

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

const testDriver = "fake.csi.example.com"

type fakeIdentity struct {
	csi.UnimplementedIdentityServer
}

func (*fakeIdentity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: testDriver, VendorVersion: "0.0.1"}, nil
}

// serveFakeDriver starts a CSI identity server on path.
func serveFakeDriver(t *testing.T, path string) {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, &fakeIdentity{})
	go srv.Serve(l)
	t.Cleanup(srv.Stop)
}

// startRegistrar runs the registrar core in the background; the returned channel yields
// run's result.
func startRegistrar(t *testing.T, ctx context.Context, dir string) (*options, <-chan error) {
	t.Helper()
	o := &options{
		csiAddress:              filepath.Join(dir, "csi.sock"),
		kubeletRegistrationPath: "/var/lib/kubelet/plugins/csi-mock/csi.sock",
		pluginRegistrationPath:  filepath.Join(dir, "registration"),
		timeout:                 time.Second,
	}
	if err := os.Mkdir(o.pluginRegistrationPath, 0o755); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- run(ctx, o) }()
	return o, done
}

// dialRegistration waits for the registration socket and connects to it as the kubelet
// plugin watcher does.
func dialRegistration(t *testing.T, socket string) registerapi.RegistrationClient {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		fi, err := os.Stat(socket)
		if err == nil && fi.Mode()&os.ModeSocket != 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("registration socket %s did not appear: %v", socket, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	conn, err := grpc.NewClient("unix:"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return registerapi.NewRegistrationClient(conn)
}

func TestRegistration(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// Start the registrar before the driver: it must wait for the driver's socket.
	o, done := startRegistrar(t, ctx, dir)
	regSocket := filepath.Join(o.pluginRegistrationPath, testDriver+"-reg.sock")
	// A socket left over from an earlier run must not get in the way.
	stale, err := net.Listen("unix", regSocket)
	if err != nil {
		t.Fatal(err)
	}
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close()
	time.Sleep(300 * time.Millisecond)
	serveFakeDriver(t, o.csiAddress)

	client := dialRegistration(t, regSocket)
	callCtx, callCancel := context.WithTimeout(ctx, 10*time.Second)
	defer callCancel()
	info, err := client.GetInfo(callCtx, &registerapi.InfoRequest{}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatalf("GetInfo: %v", err)
	}
	if info.Type != registerapi.CSIPlugin || info.Name != testDriver ||
		info.Endpoint != o.kubeletRegistrationPath || !slices.Equal(info.SupportedVersions, []string{"1.0.0"}) {
		t.Fatalf("unexpected GetInfo answer: %v", info)
	}
	if _, err := client.NotifyRegistrationStatus(callCtx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatalf("NotifyRegistrationStatus: %v", err)
	}

	// Shutting down (SIGTERM in main) ends run without error and removes the socket.
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return after cancellation")
	}
	if _, err := os.Stat(regSocket); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("registration socket still there after shutdown: %v", err)
	}
}

func TestRegistrationFailureEndsRun(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	serveFakeDriver(t, filepath.Join(dir, "csi.sock"))
	o, done := startRegistrar(t, ctx, dir)

	client := dialRegistration(t, filepath.Join(o.pluginRegistrationPath, testDriver+"-reg.sock"))
	callCtx, callCancel := context.WithTimeout(ctx, 10*time.Second)
	defer callCancel()
	if _, err := client.NotifyRegistrationStatus(callCtx, &registerapi.RegistrationStatus{
		PluginRegistered: false, Error: "version not supported",
	}, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("NotifyRegistrationStatus: %v", err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, errRegistrationFailed) {
			t.Fatalf("run returned %v, want errRegistrationFailed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not return after a failed registration")
	}
}
