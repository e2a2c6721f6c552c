package version

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"runtime"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// stamp sets the link-time variables for one test, as -ldflags -X would.
func stamp(t *testing.T, v, c string) {
	t.Helper()
	oldV, oldC := version, commit
	version, commit = v, c
	t.Cleanup(func() { version, commit = oldV, oldC })
}

func TestGetAndString(t *testing.T) {
	stamp(t, "1.2.3", "0123456789abcdef")
	require.Equal(t, Info{Version: "1.2.3", Commit: "0123456789abcdef", GoVersion: runtime.Version()}, Get())
	require.Equal(t, "1.2.3 (commit 0123456789abcdef, "+runtime.Version()+")", String())
	require.Equal(t, "1.2.3", Version())
	require.Equal(t, "0123456789abcdef", Commit())
}

func TestUnstampedCommitIsNamed(t *testing.T) {
	stamp(t, "dev", "")
	// A test binary carries no vcs.revision (GOFLAGS=-buildvcs=false or a
	// test build): the commit says so rather than being empty.
	require.NotEmpty(t, Commit())
}

func TestCollector(t *testing.T) {
	stamp(t, "1.2.3", "abc")
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(NewCollector("pilot")))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	got := map[string]map[string]string{}
	for _, mf := range mfs {
		require.Len(t, mf.GetMetric(), 1, mf.GetName())
		m := mf.GetMetric()[0]
		require.Equal(t, 1.0, m.GetGauge().GetValue(), mf.GetName())
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		got[mf.GetName()] = labels
	}
	require.Equal(t, map[string]map[string]string{
		"isthmus_build_info": {"version": "1.2.3", "commit": "abc", "go_version": runtime.Version()},
		"istio_build":        {"component": "pilot", "tag": "1.2.3"},
	}, got)
}

func TestHandler(t *testing.T) {
	stamp(t, "1.2.3", "abc")
	rec := httptest.NewRecorder()
	Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/version", nil))
	require.Equal(t, http.StatusOK, rec.Code)
	require.Equal(t, "application/json", rec.Header().Get("Content-Type"))
	var got Info
	require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &got))
	require.Equal(t, Get(), got)

	rec = httptest.NewRecorder()
	Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/version", nil))
	require.Equal(t, http.StatusMethodNotAllowed, rec.Code)
}
