package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

// syncBuffer collects klog output while gRPC goroutines write to it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

var logs syncBuffer

// TestMain configures klog as the e2e manifests do (-v=5) and captures its output.
func TestMain(m *testing.M) {
	fs := flag.NewFlagSet("klog", flag.ExitOnError)
	klog.InitFlags(fs)
	for k, v := range map[string]string{"v": "5", "logtostderr": "false", "one_output": "true"} {
		if err := fs.Set(k, v); err != nil {
			panic(err)
		}
	}
	klog.SetOutput(io.MultiWriter(&logs, os.Stderr))
	os.Exit(m.Run())
}

// loggedCall mirrors what test/e2e/storage/drivers/csi.go (MockCSICall) reads from a log line.
type loggedCall struct {
	Method  string
	Request struct {
		VolumeContext map[string]string `json:"volume_context"`
		Secrets       map[string]string `json:"secrets"`
	}
	FullError struct {
		Code    codes.Code `json:"code"`
		Message string     `json:"message"`
	}
	Error string
}

// parseCalls extracts calls the way csi.go's GetCalls does: everything after "gRPCCall:"
// on a line is JSON.
func parseCalls(t *testing.T, log string) []loggedCall {
	t.Helper()
	const prefix = "gRPCCall:"
	var calls []loggedCall
	for _, line := range strings.Split(log, "\n") {
		i := strings.Index(line, prefix)
		if i < 0 {
			continue
		}
		var c loggedCall
		if err := json.Unmarshal([]byte(line[i+len(prefix):]), &c); err != nil {
			t.Fatalf("log line does not parse as JSON: %q: %v", line, err)
		}
		calls = append(calls, c)
	}
	return calls
}

func dialUnix(t *testing.T, socket string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// startDriver serves driver mode with the flags, plus an endpoint in a temporary directory,
// until the test ends; it returns a connection to it, a context for calls and the directory.
func startDriver(t *testing.T, flags ...string) (*grpc.ClientConn, context.Context, string) {
	t.Helper()
	dir := t.TempDir()
	socket := filepath.Join(dir, "csi.sock")
	fs := flag.NewFlagSet("hostpathplugin", flag.ContinueOnError)
	cfg := addFlags(fs)
	if err := fs.Parse(append(flags, "--endpoint="+socket)); err != nil {
		t.Fatal(err)
	}
	l, err := listen(cfg.endpoint)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- serveDriver(ctx, cfg, l) }()
	t.Cleanup(func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("serveDriver: %v", err)
		}
	})
	conn := dialUnix(t, socket)
	callCtx, callCancel := context.WithTimeout(ctx, 10*time.Second)
	t.Cleanup(callCancel)
	return conn, callCtx, dir
}

func TestParseEndpoint(t *testing.T) {
	for ep, want := range map[string][2]string{
		"/csi/csi.sock":        {"unix", "/csi/csi.sock"},
		"unix:///csi/csi.sock": {"unix", "/csi/csi.sock"},
		"unix://tmp/csi.sock":  {"unix", "/tmp/csi.sock"},
		"tcp://:9000":          {"tcp", ":9000"},
	} {
		network, addr, err := parseEndpoint(ep)
		if err != nil || network != want[0] || addr != want[1] {
			t.Errorf("parseEndpoint(%q) = %q, %q, %v; want %q, %q", ep, network, addr, err, want[0], want[1])
		}
	}
	for _, ep := range []string{"unix://", "http://x"} {
		if _, _, err := parseEndpoint(ep); err == nil {
			t.Errorf("parseEndpoint(%q) did not fail", ep)
		}
	}
}

func TestDriverMode(t *testing.T) {
	// Flags as csi-mock-driver.yaml plus csi.go pass them.
	conn, callCtx, dir := startDriver(t,
		"--drivername=csi-mock-test", "--nodeid=node-1",
		"--statedir=/tmp/csi-hostpath-data", "--enable-topology", "--attach-limit", "2",
		"--node-expand-required=true",
	)
	logStart := len(logs.String())
	identity, controller, node := csi.NewIdentityClient(conn), csi.NewControllerClient(conn), csi.NewNodeClient(conn)

	info, err := identity.GetPluginInfo(callCtx, &csi.GetPluginInfoRequest{})
	if err != nil || info.Name != "csi-mock-test" {
		t.Fatalf("GetPluginInfo = %v, %v", info, err)
	}
	mount := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	vol, err := controller.CreateVolume(callCtx, &csi.CreateVolumeRequest{
		Name:               "pvc-1",
		CapacityRange:      &csi.CapacityRange{RequiredBytes: 1 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{mount},
	})
	if err != nil || vol.GetVolume().GetVolumeId() == "" {
		t.Fatalf("CreateVolume = %v, %v", vol, err)
	}
	if _, err := controller.CreateVolume(callCtx, &csi.CreateVolumeRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("CreateVolume without name: %v, want InvalidArgument", err)
	}
	nodeInfo, err := node.NodeGetInfo(callCtx, &csi.NodeGetInfoRequest{})
	if err != nil || nodeInfo.MaxVolumesPerNode != 2 || nodeInfo.AccessibleTopology == nil {
		t.Fatalf("NodeGetInfo = %v, %v", nodeInfo, err)
	}
	target := filepath.Join(dir, "target")
	volumeContext := map[string]string{"csi.storage.k8s.io/pod.name": "pod-1"}
	secrets := map[string]string{"token": "secret-value"}
	if _, err := node.NodePublishVolume(callCtx, &csi.NodePublishVolumeRequest{
		VolumeId:         vol.Volume.VolumeId,
		TargetPath:       target,
		VolumeCapability: mount,
		VolumeContext:    volumeContext,
		Secrets:          secrets,
	}); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	if fi, err := os.Stat(target); err != nil || !fi.IsDir() {
		t.Fatalf("NodePublishVolume did not create the target directory: %v", err)
	}

	calls := parseCalls(t, logs.String()[logStart:])
	var methods []string
	for _, c := range calls {
		methods = append(methods, c.Method)
	}
	wantMethods := []string{
		"/csi.v1.Identity/GetPluginInfo",
		"/csi.v1.Controller/CreateVolume",
		"/csi.v1.Controller/CreateVolume",
		"/csi.v1.Node/NodeGetInfo",
		"/csi.v1.Node/NodePublishVolume",
	}
	if !reflect.DeepEqual(methods, wantMethods) {
		t.Fatalf("logged methods %q, want %q", methods, wantMethods)
	}
	if c := calls[1]; c.Error != "" || c.FullError.Code != codes.OK {
		t.Errorf("successful CreateVolume logged with error %+v", c)
	}
	if c := calls[2]; c.FullError.Code != codes.InvalidArgument || c.FullError.Message == "" || c.Error == "" {
		t.Errorf("failed CreateVolume logged as %+v, want code InvalidArgument", c)
	}
	if c := calls[4]; !reflect.DeepEqual(c.Request.VolumeContext, volumeContext) || !reflect.DeepEqual(c.Request.Secrets, secrets) {
		t.Errorf("NodePublishVolume logged volume_context %v, secrets %v", c.Request.VolumeContext, c.Request.Secrets)
	}
}

// With attach enabled, a volume is staged and published without ControllerPublishVolume's
// "device", as upstream's host-path driver does (the mock alone would refuse it): what a pod
// needs after its CSIDriver stopped requiring attach.
func TestStageWithoutPublishContextWhileAttachIsEnabled(t *testing.T) {
	conn, callCtx, dir := startDriver(t, "--drivername=csi-mock-attach", "--enable-attach")
	controller, node := csi.NewControllerClient(conn), csi.NewNodeClient(conn)
	mount := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	vol, err := controller.CreateVolume(callCtx, &csi.CreateVolumeRequest{Name: "pvc-2", VolumeCapabilities: []*csi.VolumeCapability{mount}})
	if err != nil {
		t.Fatalf("CreateVolume: %v", err)
	}
	staging := filepath.Join(dir, "staging")
	if _, err := node.NodeStageVolume(callCtx, &csi.NodeStageVolumeRequest{
		VolumeId: vol.Volume.VolumeId, StagingTargetPath: staging, VolumeCapability: mount,
	}); err != nil {
		t.Fatalf("NodeStageVolume without a publish context: %v", err)
	}
	if _, err := node.NodePublishVolume(callCtx, &csi.NodePublishVolumeRequest{
		VolumeId: vol.Volume.VolumeId, StagingTargetPath: staging, TargetPath: filepath.Join(dir, "target"),
		VolumeCapability: mount,
	}); err != nil {
		t.Fatalf("NodePublishVolume without a publish context: %v", err)
	}
}
