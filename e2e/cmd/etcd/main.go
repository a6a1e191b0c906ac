// Command etcd is the etcd server of the release that kube-apiserver v1.36 is tested with,
// built from the etcd server module so no prebuilt binary has to be downloaded.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
