package sni

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestParse: only Istio's outbound_.<port>_._.<hostname>, without a subset,
// with a port 1-65535 written without a leading zero, parses.
func TestParse(t *testing.T) {
	for _, tc := range []struct {
		sni  string
		host string
		port uint16
		ok   bool
	}{
		{"outbound_.8080_._.echo.default.svc.cluster.local", "echo.default.svc.cluster.local", 8080, true},
		{Outbound("a.b.svc.cluster.local", 1), "a.b.svc.cluster.local", 1, true},
		{"outbound_.8080_.v1_.echo.default.svc.cluster.local", "", 0, false}, // a subset
		{"inbound_.8080_._.echo.default.svc.cluster.local", "", 0, false},
		{"outbound_.0_._.echo", "", 0, false},
		{"outbound_.08080_._.echo", "", 0, false},
		{"outbound_.70000_._.echo", "", 0, false},
		{"outbound_.8080_._.", "", 0, false},
		{"echo.default.svc.cluster.local", "", 0, false},
		{"", "", 0, false},
	} {
		host, port, err := Parse(tc.sni)
		if !tc.ok {
			require.Error(t, err, tc.sni)
			continue
		}
		require.NoError(t, err, tc.sni)
		require.Equal(t, tc.host, host)
		require.Equal(t, tc.port, port)
	}
}

// FuzzParse: no input panics, and a parsed name prints back as itself.
func FuzzParse(f *testing.F) {
	f.Add("outbound_.8080_._.echo.default.svc.cluster.local")
	f.Add("outbound_.1_._.x")
	f.Fuzz(func(t *testing.T, sni string) {
		host, port, err := Parse(sni)
		if err != nil {
			return
		}
		require.Equal(t, sni, Outbound(host, port), "a parsed name must print back as itself")
	})
}
