// The custom.metrics.k8s.io API server the operator tests run: sigs.k8s.io/custom-metrics-apiserver with its
// in-memory test provider, whose values a test POSTs to /write-metrics/... on --write-address (loopback only; the
// upstream sample binds :8080 on every interface). tools.sh builds it in a throw-away module pinned to one release.
package main

import (
	"context"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/emicklei/go-restful/v3"
	"k8s.io/component-base/logs"
	"k8s.io/klog/v2"

	basecmd "sigs.k8s.io/custom-metrics-apiserver/pkg/cmd"
	fakeprov "sigs.k8s.io/custom-metrics-apiserver/test-adapter/provider"
)

func main() {
	logs.InitLogs()
	defer logs.FlushLogs()

	cmd := &basecmd.AdapterBase{Name: "h3serve-test-metrics-adapter"}
	writeAddr := cmd.Flags().String("write-address", "127.0.0.1:0", "host:port of the plain-HTTP /write-metrics endpoint")
	logs.AddFlags(cmd.Flags())
	if err := cmd.Flags().Parse(os.Args[1:]); err != nil {
		klog.Fatalf("unable to parse flags: %v", err)
	}

	client, err := cmd.DynamicClient()
	if err != nil {
		klog.Fatalf("unable to construct dynamic client: %v", err)
	}
	mapper, err := cmd.RESTMapper()
	if err != nil {
		klog.Fatalf("unable to construct discovery REST mapper: %v", err)
	}
	prov, ws := fakeprov.NewFakeProvider(client, mapper)
	cmd.WithCustomMetrics(prov)

	container := restful.NewContainer()
	container.Add(ws)
	ln, err := net.Listen("tcp", *writeAddr)
	if err != nil {
		klog.Fatalf("unable to listen on %s: %v", *writeAddr, err)
	}
	klog.Infof("write endpoint on http://%s/write-metrics", ln.Addr())
	go func() {
		server := &http.Server{Handler: container, ReadHeaderTimeout: 3 * time.Second}
		klog.Fatal(server.Serve(ln))
	}()
	if err := cmd.Run(context.Background()); err != nil {
		klog.Fatalf("unable to run the custom metrics adapter: %v", err)
	}
}
