package spiffe

import (
	"crypto/x509"
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Identity
		ok   bool
	}{
		{"spiffe://cluster.local/ns/demo/sa/echo", Identity{"cluster.local", "demo", "echo"}, true},
		{"spiffe://td_1.example/ns/a-b/sa/c.d", Identity{"td_1.example", "a-b", "c.d"}, true},
		{"spiffe://cluster.local/ns/demo/sa/echo/extra", Identity{}, false},
		{"spiffe://cluster.local/ns/demo", Identity{}, false},
		{"spiffe://cluster.local/sa/echo/ns/demo", Identity{}, false},
		{"spiffe://cluster.local/ns//sa/echo", Identity{}, false},
		{"spiffe://Cluster.Local/ns/demo/sa/echo", Identity{}, false},
		{"spiffe://cluster.local:8080/ns/demo/sa/echo", Identity{}, false},
		{"spiffe://user@cluster.local/ns/demo/sa/echo", Identity{}, false},
		{"spiffe://cluster.local/ns/demo/sa/echo?x=1", Identity{}, false},
		{"spiffe://cluster.local/ns/../sa/echo", Identity{}, false},
		{"https://cluster.local/ns/demo/sa/echo", Identity{}, false},
		{"", Identity{}, false},
	} {
		got, err := Parse(tc.in)
		if !tc.ok {
			require.Error(t, err, tc.in)
			continue
		}
		require.NoError(t, err, tc.in)
		require.Equal(t, tc.want, got)
		require.Equal(t, tc.in, got.String())
		require.Equal(t, tc.in, got.URL().String())
	}
}

func TestNew(t *testing.T) {
	id, err := New("cluster.local", "ns", "sa")
	require.NoError(t, err)
	require.Equal(t, "spiffe://cluster.local/ns/ns/sa/sa", id.String())
	_, err = New("cluster.local", "a/b", "sa")
	require.Error(t, err)
	_, err = New("", "ns", "sa")
	require.Error(t, err)
	require.Equal(t, "", Identity{}.String())
	require.True(t, Identity{}.IsZero())
}

func TestFromCertificate(t *testing.T) {
	u := func(s string) *url.URL { v, err := url.Parse(s); require.NoError(t, err); return v }
	id, err := FromCertificate(&x509.Certificate{URIs: []*url.URL{u("spiffe://td/ns/a/sa/b")}})
	require.NoError(t, err)
	require.Equal(t, Identity{"td", "a", "b"}, id)
	_, err = FromCertificate(&x509.Certificate{})
	require.Error(t, err, "no URI SAN")
	_, err = FromCertificate(&x509.Certificate{URIs: []*url.URL{u("spiffe://td/ns/a/sa/b"), u("spiffe://td/ns/c/sa/d")}})
	require.Error(t, err, "two URI SANs")
	_, err = FromCertificate(&x509.Certificate{URIs: []*url.URL{u("spiffe://td/workload")}})
	require.ErrorIs(t, err, ErrNotWorkloadID)
}
