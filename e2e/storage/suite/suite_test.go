// Package suite is Kubernetes' storage e2e suite, as test/e2e's own TestMain and RunE2ETests run
// it, with only the areas that test storage compiled in (not every e2e area and cloud provider, so
// a cold build is a fraction of the whole e2e.test's):
//   - the "External Storage" suites of test/e2e/storage/external, driven by a driver-definition
//     file given with -storage.testdriver: they certify a CSI driver;
//   - the tests Kubernetes wrote for the storage controllers themselves: test/e2e/storage (PV and
//     PVC protection, the PV lifecycle, VolumeAttachment, local PVs, the default class),
//     test/e2e/storage/csimock (the CSI mock driver), and the StatefulSet tests of
//     test/e2e/apps, whose claims exercise the binder, attach/detach and pvc-protection.
//
// A run picks its tests with ginkgo's --focus (e2e/scripts/e2e-storage.sh); the in-tree drivers
// that test/e2e/storage also registers are never focused.
package suite

import (
	"context"
	"flag"
	"fmt"
	"os"
	"testing"

	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"

	"k8s.io/component-base/logs"
	"k8s.io/component-base/version"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/test/e2e/framework"
	"k8s.io/kubernetes/test/e2e/framework/config"
	e2enode "k8s.io/kubernetes/test/e2e/framework/node"
	"k8s.io/kubernetes/test/e2e/framework/testfiles"
	e2etestingmanifests "k8s.io/kubernetes/test/e2e/testing-manifests"
	testfixtures "k8s.io/kubernetes/test/fixtures"
	imageutils "k8s.io/kubernetes/test/utils/image"

	// The feature names the storage tests are labelled with.
	_ "k8s.io/kubernetes/test/e2e/feature"
	// The External Storage suites; -storage.testdriver registers one driver's tests.
	_ "k8s.io/kubernetes/test/e2e/storage/external"
	// The storage controllers' own tests.
	_ "k8s.io/kubernetes/test/e2e/apps"
	_ "k8s.io/kubernetes/test/e2e/storage"
	_ "k8s.io/kubernetes/test/e2e/storage/csimock"

	// As test/e2e does: debug dumps on failure, node checks, and the test value formatters.
	_ "k8s.io/kubernetes/test/e2e/framework/debug/init"
	_ "k8s.io/kubernetes/test/e2e/framework/node/init"
	_ "k8s.io/kubernetes/test/utils/format"

	// Logging flags (-v) on the command line.
	_ "k8s.io/component-base/logs/testinit"
)

func TestMain(m *testing.M) {
	showVersion := flag.Bool("version", false, "Print the version of the suite and exit.")
	listImages := flag.Bool("list-storage-images", false,
		"Print the images the storage tests run (busybox, agnhost, nginx, glibc-dns-testing, the previous agnhost, pause) and exit.")
	config.CopyFlags(config.Flags, flag.CommandLine)
	framework.RegisterCommonFlags(flag.CommandLine)
	framework.RegisterClusterFlags(flag.CommandLine)
	flag.Parse()
	if *showVersion {
		fmt.Println(version.Get())
		os.Exit(0)
	}
	if *listImages {
		// -list-images prints every image of the release, several versions of some; these are
		// the exact names the storage suites' pods ask for.
		for _, id := range []imageutils.ImageID{imageutils.BusyBox, imageutils.Agnhost, imageutils.Nginx, imageutils.GlibcDnsTesting, imageutils.AgnhostPrev, imageutils.Pause} {
			fmt.Println(imageutils.GetE2EImage(id))
		}
		os.Exit(0)
	}
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unknown arguments: %v\n", flag.Args())
		os.Exit(1)
	}
	testfiles.AddFileSource(e2etestingmanifests.GetE2ETestingManifestsFS())
	testfiles.AddFileSource(testfixtures.GetTestFixturesFS())
	// Files named by path, as upstream's e2e.test reads them: a driver definition's
	// StorageClass.FromFile (absolute, or relative to -repo-root).
	testfiles.AddFileSource(testfiles.RootFileSource{Root: framework.TestContext.RepoRoot})
	framework.AfterReadingAllFlags(&framework.TestContext)
	os.Exit(m.Run())
}

func TestStorage(t *testing.T) {
	logs.InitLogs()
	defer logs.FlushLogs()
	klog.EnableContextualLogging(true)
	gomega.RegisterFailHandler(framework.Fail)
	suiteConfig, reporterConfig := framework.CreateGinkgoConfig()
	ginkgo.RunSpecs(t, "Kubernetes storage e2e suite", suiteConfig, reporterConfig)
}

// Once per run, as test/e2e's setupSuite does for what these tests rely on: every node
// schedulable, and the number of nodes known (the multi-node tests skip below two).
var _ = ginkgo.SynchronizedBeforeSuite(func(ctx context.Context) []byte {
	c, err := framework.LoadClientset()
	framework.ExpectNoError(err, "loading the client")
	timeouts := framework.NewTimeoutContext()
	framework.ExpectNoError(e2enode.WaitForAllNodesSchedulable(ctx, c, timeouts.NodeSchedulable))
	nodes, err := e2enode.GetReadySchedulableNodes(ctx, c)
	framework.ExpectNoError(err)
	framework.Logf("e2e suite %s, %d schedulable nodes", version.Get().GitVersion, len(nodes.Items))
	return nil
}, func(ctx context.Context, _ []byte) {
	// Every parallel process: the IP family some helpers read (this cluster is IPv4).
	framework.TestContext.IPFamily = "ipv4"
})
