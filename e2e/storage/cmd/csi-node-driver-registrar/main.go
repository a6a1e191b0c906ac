// Command csi-node-driver-registrar stands in for the image
// registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.16.0 that Kubernetes' CSI mock e2e
// tests (test/e2e/storage/csimock) deploy next to their mock driver. Its upstream module,
// github.com/kubernetes-csi/node-driver-registrar, is not served by the Go module proxy here,
// so this is a small reimplementation of just the part those manifests use: ask the CSI driver
// for its name, then answer the kubelet's plugin-registration calls on
// <plugin-registration-path>/<driver name>-reg.sock until SIGTERM.
package main

import (
	"context"
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
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"stowage.dev/e2e/storage/internal/sock"
)

// supportedVersions is what the kubelet's CSI plugin handler accepts.
var supportedVersions = []string{"1.0.0"}

// errRegistrationFailed is returned by run when the kubelet reports that it could not
// register the driver; upstream exits non-zero then so that the container restarts and
// registration is tried again.
var errRegistrationFailed = errors.New("kubelet reported that plugin registration failed")

type options struct {
	csiAddress              string
	kubeletRegistrationPath string
	pluginRegistrationPath  string
	timeout                 time.Duration

	// Upstream flags for features this stand-in leaves out (HTTP health and profiling
	// server, probe mode, deprecated ones): accepted so that existing manifests keep
	// working, otherwise ignored.
	healthPort        int
	httpEndpoint      string
	mode              string
	connectionTimeout time.Duration
	enablePprof       bool
}

func addFlags(fs *flag.FlagSet) *options {
	o := &options{}
	fs.StringVar(&o.csiAddress, "csi-address", "/run/csi/socket", "Path of the CSI driver socket to connect to.")
	fs.StringVar(&o.kubeletRegistrationPath, "kubelet-registration-path", "", "Path of the CSI driver socket on the host, as the kubelet must use it.")
	fs.StringVar(&o.pluginRegistrationPath, "plugin-registration-path", "/registration", "Kubelet plugin registration directory.")
	fs.DurationVar(&o.timeout, "timeout", time.Second, "Timeout of each gRPC call to the driver.")
	fs.IntVar(&o.healthPort, "health-port", 0, "Accepted for compatibility, ignored.")
	fs.StringVar(&o.httpEndpoint, "http-endpoint", "", "Accepted for compatibility, ignored.")
	fs.StringVar(&o.mode, "mode", "", "Accepted for compatibility; kubelet-registration-probe exits 0 at once, as upstream.")
	fs.DurationVar(&o.connectionTimeout, "connection-timeout", 0, "Deprecated upstream, ignored.")
	fs.BoolVar(&o.enablePprof, "enable-pprof", false, "Accepted for compatibility, ignored.")
	return o
}

func main() {
	klog.InitFlags(nil)
	opts := addFlags(flag.CommandLine)
	flag.Parse()
	if opts.kubeletRegistrationPath == "" {
		klog.ErrorS(nil, "kubelet-registration-path is a required parameter")
		klog.FlushAndExit(klog.ExitFlushTimeout, 1)
	}
	if opts.mode == "kubelet-registration-probe" {
		// Upstream turned this mode into a no-op that succeeds.
		return
	}
	if opts.healthPort != 0 || opts.httpEndpoint != "" || opts.connectionTimeout != 0 || opts.enablePprof {
		klog.InfoS("Ignoring --health-port, --http-endpoint, --connection-timeout and --enable-pprof: this stand-in has no HTTP server")
	}

	// The kubelet stops the container with SIGTERM; the socket must go away with it.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, opts); err != nil {
		klog.ErrorS(err, "node-driver-registrar stopped")
		klog.FlushAndExit(klog.ExitFlushTimeout, 1)
	}
	klog.Flush()
}

// run learns the driver name, then serves the registration socket until ctx is done (nil) or
// the kubelet reports a failed registration (errRegistrationFailed).
func run(ctx context.Context, o *options) error {
	klog.InfoS("Running node-driver-registrar stand-in", "csiAddress", o.csiAddress, "kubeletRegistrationPath", o.kubeletRegistrationPath)
	name, err := driverName(ctx, o.csiAddress, o.timeout)
	if ctx.Err() != nil {
		return nil // stopped before the driver answered; nothing to clean up
	}
	if err != nil {
		return err
	}
	klog.V(2).InfoS("CSI driver name", "csiDriverName", name)

	socketPath := filepath.Join(o.pluginRegistrationPath, name+"-reg.sock")
	if err := sock.RemoveStale(socketPath); err != nil {
		return err
	}
	lis, err := net.Listen("unix", socketPath)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", socketPath, err)
	}
	// Upstream creates the socket under umask 0077; only the kubelet (root) needs it.
	if err := os.Chmod(socketPath, 0o600); err != nil {
		lis.Close()
		return err
	}
	defer os.Remove(socketPath)
	klog.InfoS("Registration Server started", "socketPath", socketPath)

	failed := make(chan string, 1)
	srv := grpc.NewServer()
	registerapi.RegisterRegistrationServer(srv, &registrationServer{
		info: &registerapi.PluginInfo{
			Type:              registerapi.CSIPlugin,
			Name:              name,
			Endpoint:          o.kubeletRegistrationPath,
			SupportedVersions: supportedVersions,
		},
		failed: failed,
	})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()

	select {
	case <-ctx.Done():
		klog.InfoS("Shutting down, removing registration socket", "socketPath", socketPath)
		srv.Stop()
		return nil
	case msg := <-failed:
		// Let the kubelet receive the reply to its notification before the connection goes.
		stopGracefully(srv, 2*time.Second)
		return fmt.Errorf("%w: %s", errRegistrationFailed, msg)
	case err := <-served:
		return fmt.Errorf("registration server stopped: %w", err)
	}
}

// stopGracefully waits up to limit for in-flight calls to finish.
func stopGracefully(srv *grpc.Server, limit time.Duration) {
	stopped := make(chan struct{})
	go func() { srv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(limit):
		srv.Stop()
	}
}

// driverName calls Identity.GetPluginInfo until the driver answers. The driver container
// usually starts at the same time as this one, so its socket may not exist yet.
func driverName(ctx context.Context, address string, timeout time.Duration) (string, error) {
	target := address
	if !strings.Contains(address, "://") {
		// "unix:" + path works for absolute and relative paths alike.
		target = "unix:" + address
	}
	// Reconnect at least every second: the default backoff grows to two minutes, which
	// would delay registration long after the driver came up.
	conn, err := grpc.NewClient(target,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, MaxDelay: time.Second},
			MinConnectTimeout: timeout,
		}))
	if err != nil {
		return "", fmt.Errorf("connect to %s: %w", address, err)
	}
	// The connection is needed only once; in the e2e proxy setup every idle connection
	// would hold one of the few tunnels the test process keeps open.
	defer conn.Close()

	client := csi.NewIdentityClient(conn)
	for {
		callCtx, cancel := context.WithTimeout(ctx, timeout)
		resp, err := client.GetPluginInfo(callCtx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true))
		cancel()
		switch {
		case err == nil && resp.GetName() == "":
			return "", errors.New("CSI driver returned an empty name")
		case err == nil:
			return resp.GetName(), nil
		case ctx.Err() != nil:
			return "", ctx.Err()
		}
		switch status.Code(err) {
		case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled:
			klog.InfoS("Still connecting to CSI driver", "csiAddress", address, "err", err)
		default:
			return "", fmt.Errorf("GetPluginInfo: %w", err)
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// registrationServer implements the kubelet plugin-registration service.
type registrationServer struct {
	registerapi.UnimplementedRegistrationServer
	info   *registerapi.PluginInfo
	failed chan<- string
}

func (s *registrationServer) GetInfo(ctx context.Context, req *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	klog.V(4).InfoS("Received GetInfo call", "request", req)
	return s.info, nil
}

func (s *registrationServer) NotifyRegistrationStatus(ctx context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	klog.InfoS("Received NotifyRegistrationStatus call", "status", st)
	if !st.GetPluginRegistered() {
		klog.ErrorS(errors.New(st.GetError()), "Registration process failed with error, restarting registration container")
		select {
		case s.failed <- st.GetError():
		default: // a failure is already pending; one is enough to exit
		}
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}
