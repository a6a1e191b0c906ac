// Command hostpathplugin stands in for the image registry.k8s.io/sig-storage/hostpathplugin:v1.17.1
// as Kubernetes' CSI mock e2e tests (test/e2e/storage/csimock) deploy it, in the "mock" container
// of test/e2e/testing-manifests/storage-csi/mock/csi-mock-{driver,proxy}.yaml. Its upstream module,
// github.com/kubernetes-csi/csi-driver-host-path, is not served by the Go module proxy here.
//
// It has two modes, as upstream:
//   - with --proxy-endpoint it only forwards connections from the CSI socket to TCP connections
//     that the e2e test process opens through port forwarding; the test process runs the mock
//     driver itself (see proxy.go).
//   - otherwise it serves a CSI driver on --endpoint. Instead of upstream's real host-path
//     driver it serves the mock CSI service from the Kubernetes e2e tree
//     (test/e2e/storage/drivers/csi-test/mock/service), the same code the e2e process embeds in
//     proxy mode, configured from the flags csi.go passes. Every call is logged as
//     "gRPCCall: <JSON>" at -v=5, the lines the tests read back from the container log.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/test/e2e/storage/drivers/csi-test/mock/service"
	"stowage.dev/e2e/storage/internal/sock"
)

type config struct {
	endpoint      string
	proxyEndpoint string
	driverName    string
	nodeID        string
	stateDir      string

	enableAttach               bool
	enableTopology             bool
	nodeExpandRequired         bool
	disableControllerExpansion bool
	attachLimit                int64
}

// addFlags registers the upstream flags that the e2e manifests and csi.go pass, plus
// --disable-controller-expansion, the one other upstream flag the mock service can honour.
// Defaults of the feature flags follow the mock service (everything off), because csi.go
// passes each of them only when a test wants the feature on.
func addFlags(fs *flag.FlagSet) *config {
	c := &config{}
	defaultEndpoint := os.Getenv("CSI_ENDPOINT")
	if defaultEndpoint == "" {
		defaultEndpoint = "unix:///tmp/csi.sock"
	}
	fs.StringVar(&c.endpoint, "endpoint", defaultEndpoint, "CSI endpoint: unix socket path or unix:// URL (default $CSI_ENDPOINT).")
	fs.StringVar(&c.proxyEndpoint, "proxy-endpoint", "", "Only proxy connections from --endpoint to connections accepted on this address (tcp://host:port).")
	fs.StringVar(&c.driverName, "drivername", "hostpath.csi.k8s.io", "Name of the driver.")
	fs.StringVar(&c.nodeID, "nodeid", "", "Node id. Accepted; the mock service always reports the driver name as node id.")
	fs.StringVar(&c.stateDir, "statedir", "/csi-data-dir", "State directory. Accepted; the mock service keeps its state in memory.")
	fs.BoolVar(&c.enableAttach, "enable-attach", false, "Enable ControllerPublish/UnpublishVolume.")
	fs.BoolVar(&c.enableTopology, "enable-topology", false, "Report volume topology.")
	fs.BoolVar(&c.nodeExpandRequired, "node-expand-required", false, "Report the EXPAND_VOLUME node capability.")
	fs.BoolVar(&c.disableControllerExpansion, "disable-controller-expansion", false, "Do not report the EXPAND_VOLUME controller capability.")
	fs.Int64Var(&c.attachLimit, "attach-limit", 0, "Maximum number of attachable volumes on the node; 0 means no limit.")
	return c
}

func main() {
	klog.InitFlags(nil)
	cfg := addFlags(flag.CommandLine)
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(),
		syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT)
	defer stop()

	var err error
	if cfg.proxyEndpoint != "" {
		var p *proxy
		if p, err = newProxy(cfg.endpoint, cfg.proxyEndpoint); err == nil {
			err = p.run(ctx)
		}
	} else {
		var l net.Listener
		if l, err = listen(cfg.endpoint); err == nil {
			err = serveDriver(ctx, cfg, l)
		}
	}
	if err != nil {
		klog.ErrorS(err, "hostpathplugin stopped")
		klog.FlushAndExit(klog.ExitFlushTimeout, 1)
	}
	klog.Flush()
}

// parseEndpoint accepts "unix://path", "tcp://host:port" or a plain socket path.
func parseEndpoint(ep string) (network, addr string, err error) {
	network, addr = "unix", ep
	if scheme, rest, ok := strings.Cut(ep, "://"); ok {
		network, addr = strings.ToLower(scheme), rest
	}
	switch {
	case addr == "":
		return "", "", fmt.Errorf("invalid endpoint %q", ep)
	case network == "unix" && !filepath.IsAbs(addr):
		// Upstream v1.17.1 turns "unix://tmp/csi.sock", its own default, into /tmp/csi.sock.
		addr = "/" + addr
	case network != "unix" && network != "tcp":
		return "", "", fmt.Errorf("unsupported endpoint %q", ep)
	}
	return network, addr, nil
}

// listen opens an endpoint, replacing a socket that an earlier container left behind.
// A unix listener created by net.Listen removes its socket file again when closed.
func listen(ep string) (net.Listener, error) {
	network, addr, err := parseEndpoint(ep)
	if err != nil {
		return nil, err
	}
	if network == "unix" {
		if err := sock.RemoveStale(addr); err != nil {
			return nil, err
		}
	}
	l, err := net.Listen(network, addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", ep, err)
	}
	return l, nil
}

// serveDriver serves the e2e mock CSI service on l until ctx is done.
func serveDriver(ctx context.Context, c *config, l net.Listener) error {
	if c.nodeID != "" {
		klog.InfoS("Ignoring --nodeid: the mock service reports the driver name as node id", "nodeid", c.nodeID)
	}
	svc := service.New(service.Config{
		DriverName:                 c.driverName,
		DisableAttach:              !c.enableAttach,
		EnableTopology:             c.enableTopology,
		AttachLimit:                c.attachLimit,
		NodeExpansionRequired:      c.nodeExpandRequired,
		DisableControllerExpansion: c.disableControllerExpansion,
		// The mock creates and removes target directories for real; in the e2e pod
		// /var/lib/kubelet/pods is a hostPath mount, so the kubelet sees them.
		IO: service.OSDirIO{},
	})
	srv := grpc.NewServer(grpc.UnaryInterceptor(logCall))
	csi.RegisterIdentityServer(srv, svc)
	csi.RegisterControllerServer(srv, svc)
	csi.RegisterNodeServer(srv, hostpathNode{svc})

	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	klog.InfoS("Listening for connections", "address", l.Addr().String(), "driver", c.driverName)
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	stopped := make(chan struct{})
	go func() { srv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		srv.Stop()
	}
	return nil
}

// hostpathNode is the mock's node service with one difference, upstream's host-path driver's:
// staging and publishing never need the "device" that ControllerPublishVolume returns. The
// mock refuses a stage without it whenever attach is enabled, so a volume whose CSIDriver
// stopped requiring attach (the attach tests flip attachRequired while a pod waits) could never
// be mounted, where the real image mounts it.
type hostpathNode struct{ csi.NodeServer }

func (n hostpathNode) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	if _, ok := req.PublishContext["device"]; !ok {
		req.PublishContext = withDevice(req.PublishContext)
	}
	return n.NodeServer.NodeStageVolume(ctx, req)
}

func (n hostpathNode) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	if _, ok := req.PublishContext["device"]; !ok {
		req.PublishContext = withDevice(req.PublishContext)
	}
	return n.NodeServer.NodePublishVolume(ctx, req)
}

// withDevice is a copy of ctx with the device the mock would have made up without attach.
func withDevice(ctx map[string]string) map[string]string {
	out := map[string]string{"device": "mock device"}
	for k, v := range ctx {
		out[k] = v
	}
	return out
}

// callLog is the JSON the e2e tests parse (test/e2e/storage/drivers/csi.go, MockCSICall).
// FullError is the gRPC status as a proto, so that "code" and "message" can be read back;
// this is how the e2e process logs calls of its embedded mock driver. Secrets are logged
// unredacted on purpose: tests compare them.
type callLog struct {
	Method    string
	Request   any
	Response  any
	Error     string // "" on success
	FullError any    // *spb.Status, null on success
}

func logCall(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	level := klog.Level(3)
	if info.FullMethod == "/csi.v1.Identity/Probe" {
		level = 5 // sidecars probe often
	}
	klog.V(level).Infof("GRPC call: %s", info.FullMethod)
	resp, err := handler(ctx, req)
	if err != nil {
		klog.ErrorS(err, "GRPC error", "method", info.FullMethod)
	}
	if v := klog.V(5); v.Enabled() {
		entry := callLog{Method: info.FullMethod, Request: req, Response: resp}
		if err != nil {
			entry.Error = err.Error()
			entry.FullError = status.Convert(err).Proto()
		}
		msg, jerr := json.Marshal(entry)
		if jerr != nil {
			msg, _ = json.Marshal(callLog{Method: info.FullMethod, Error: errors.Join(err, jerr).Error()})
		}
		v.Infof("gRPCCall: %s", msg)
	}
	return resp, err
}
