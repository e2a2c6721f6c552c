package ca

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestParseIdentity(t *testing.T) {
	tests := []struct {
		in      string
		want    Identity
		wantErr bool
	}{
		{in: "spiffe://cluster.local/ns/app/sa/web", want: Identity{TrustDomain: "cluster.local", Namespace: "app", ServiceAccount: "web"}},
		{in: "spiffe://cluster.local/ns/app/sa/web.v1", want: Identity{TrustDomain: "cluster.local", Namespace: "app", ServiceAccount: "web.v1"}},
		{in: "https://cluster.local/ns/app/sa/web", wantErr: true},
		{in: "spiffe:///ns/app/sa/web", wantErr: true},
		{in: "spiffe://cluster.local/ns/app/sa/web/extra", wantErr: true},
		{in: "spiffe://cluster.local/ns/App/sa/web", wantErr: true},
		{in: "spiffe://cluster.local/sa/web/ns/app", wantErr: true},
		{in: "spiffe://cluster.local:8080/ns/app/sa/web", wantErr: true},
		{in: "spiffe://cluster.local/ns/app/sa/web?x=1", wantErr: true},
		{in: "", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			got, err := ParseIdentity(tc.in)
			if tc.wantErr {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
			require.Equal(t, tc.in, got.String())
		})
	}
}

func TestConfigDefaultsAndValidation(t *testing.T) {
	cfg := Config{ClusterID: "primary"}.withDefaults()
	require.NoError(t, cfg.validate())
	require.Equal(t, "isthmus-system", cfg.Namespace)
	require.Equal(t, "cluster.local", cfg.TrustDomain)
	require.Equal(t, []string{"istio-ca"}, cfg.Audiences)
	require.Equal(t, []string{"isthmus-system/ztunnel"}, cfg.TrustedNodeAccounts)
	require.Equal(t, 24*time.Hour, cfg.DefaultTTL)
	require.Equal(t, []string{"isthmusd.isthmus-system.svc"}, cfg.ServingSANs)

	off := Config{ClusterID: "primary", NoTrustedNodeAccounts: true, TrustedNodeAccounts: []string{"a/b"}}.withDefaults()
	require.Empty(t, off.TrustedNodeAccounts)

	bad := []Config{
		{},
		{ClusterID: "c", TrustDomain: "Bad Domain"},
		{ClusterID: "c", DefaultTTL: 2 * time.Hour, MaxTTL: time.Hour},
		{ClusterID: "c", TrustedNodeAccounts: []string{"ztunnel"}},
	}
	for _, c := range bad {
		require.Error(t, c.withDefaults().validate(), "%+v", c)
	}
}

func TestBearerTokenAndUnverifiedClaims(t *testing.T) {
	require.Equal(t, "abc", bearerToken([]string{"Bearer abc"}))
	require.Equal(t, "abc", bearerToken([]string{"bearer  abc"}))
	require.Empty(t, bearerToken([]string{"Basic abc"}))
	require.Empty(t, bearerToken(nil))

	// header {"alg":"none"}, payload {"exp":5,"aud":"istio-ca"}
	c := unverifiedClaims("eyJhbGciOiJub25lIn0.eyJleHAiOjUsImF1ZCI6ImlzdGlvLWNhIn0.sig")
	require.NotNil(t, c)
	require.Equal(t, int64(5), c.Exp)
	require.Equal(t, []string{"istio-ca"}, []string(c.Aud))
	require.Nil(t, unverifiedClaims("not-a-jwt"))
}
