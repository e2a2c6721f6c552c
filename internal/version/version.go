// Package version holds the version and commit stamped into every Isthmus
// binary at link time, and exposes them as a string, a JSON endpoint and the
// isthmus_build_info metric.
//
// The release build (make build, make images) sets both with
//
//	-ldflags "-X github.com/isthmus-mesh/isthmus/internal/version.version=0.1.0
//	          -X github.com/isthmus-mesh/isthmus/internal/version.commit=<sha>"
//
// A plain `go build` leaves version "dev" and takes the commit from the
// VCS stamp of the build info when the go command recorded one.
package version

import (
	"encoding/json"
	"fmt"
	"net/http"
	"runtime"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
)

// Link-time stamps: the only package variables of the project, because
// -ldflags -X can set nothing else. Read them through Get.
var (
	version = "dev"
	commit  = ""
)

// Info describes one binary's build.
type Info struct {
	// Version is the project version (the VERSION file at release), "dev"
	// when not stamped.
	Version string `json:"version"`
	// Commit is the git commit the binary was built from, "unknown" when
	// neither stamped nor recorded by the go command.
	Commit string `json:"commit"`
	// GoVersion is the Go toolchain that built the binary.
	GoVersion string `json:"goVersion"`
}

// Get returns the running binary's build information.
func Get() Info {
	c := commit
	if c == "" {
		c = "unknown"
		if bi, ok := debug.ReadBuildInfo(); ok {
			for _, s := range bi.Settings {
				if s.Key == "vcs.revision" && s.Value != "" {
					c = s.Value
				}
			}
		}
	}
	return Info{Version: version, Commit: c, GoVersion: runtime.Version()}
}

// Version is Get().Version.
func Version() string { return Get().Version }

// Commit is Get().Commit.
func Commit() string { return Get().Commit }

// String is the one-line form every binary prints for --version, e.g.
// "0.1.0 (commit 1a2b3c..., go1.26.8)".
func String() string { return Get().String() }

// String formats i as "<version> (commit <commit>, <go version>)".
func (i Info) String() string {
	return fmt.Sprintf("%s (commit %s, %s)", i.Version, i.Commit, i.GoVersion)
}

// NewCollector returns the gauges isthmus_build_info{version,commit,go_version}
// and Istio's istio_build{component,tag} (tag the version), both 1, to
// register in the Prometheus registry of the binary component names
// ("pilot", "ztunnel": the values Istio's dashboards select on).
func NewCollector(component string) prometheus.Collector {
	i := Get()
	own := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "isthmus_build_info",
		Help:        "Always 1; the labels say which build of Isthmus is running.",
		ConstLabels: prometheus.Labels{"version": i.Version, "commit": i.Commit, "go_version": i.GoVersion},
	})
	istio := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "istio_build",
		Help:        "Istio component build info (Istio's metric): always 1, tag is the Isthmus version.",
		ConstLabels: prometheus.Labels{"component": component, "tag": i.Version},
	})
	own.Set(1)
	istio.Set(1)
	return buildCollector{own, istio}
}

// buildCollector collects the two build gauges as one collector.
type buildCollector [2]prometheus.Gauge

// Describe implements prometheus.Collector.
func (b buildCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, g := range b {
		g.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (b buildCollector) Collect(ch chan<- prometheus.Metric) {
	for _, g := range b {
		g.Collect(ch)
	}
}

// Handler serves Get() as JSON (pilot's /version, read by `isthmusctl
// version`).
func Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(Get())
	})
}
