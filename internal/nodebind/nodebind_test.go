package nodebind_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"errors"
	"math/big"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/nodebind"
)

func certWith(t *testing.T, exts ...pkix.Extension) *x509.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), ExtraExtensions: exts}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	c, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return c
}

func TestRoundTrip(t *testing.T) {
	ext, err := nodebind.Binding{Cluster: "c1", Node: "node-a.example"}.Extension()
	require.NoError(t, err)
	require.False(t, ext.Critical)
	got, err := nodebind.FromCertificate(certWith(t, ext))
	require.NoError(t, err)
	require.Equal(t, nodebind.Binding{Cluster: "c1", Node: "node-a.example"}, got)
}

func TestRefusals(t *testing.T) {
	_, err := nodebind.FromCertificate(certWith(t))
	require.ErrorIs(t, err, nodebind.ErrAbsent)

	for name, b := range map[string]nodebind.Binding{
		"empty node": {Cluster: "c1"}, "empty cluster": {Node: "n"}, "node not a name": {Cluster: "c1", Node: "a/b"},
		"cluster not a label": {Cluster: "c.1", Node: "n"},
	} {
		_, err := b.Extension()
		require.Error(t, err, name)
	}

	good, err := nodebind.Binding{Cluster: "c1", Node: "n"}.Extension()
	require.NoError(t, err)
	critical := good
	critical.Critical = true
	// x509 itself keeps an unknown critical extension for the verifier to refuse.
	_, err = nodebind.FromCertificate(certWith(t, critical))
	require.Error(t, err)

	bad := func(v []byte) pkix.Extension { return pkix.Extension{Id: nodebind.OID, Value: v} }
	utf8Seq := func(a, b string) []byte {
		der, err := asn1.Marshal(struct {
			A string `asn1:"utf8"`
			B string `asn1:"utf8"`
		}{a, b})
		require.NoError(t, err)
		return der
	}
	printable, err := asn1.Marshal(struct{ A, B string }{"c1", "n"})
	require.NoError(t, err)
	for name, v := range map[string][]byte{
		"not DER":                   {0x30, 0x80, 0x00, 0x00},
		"trailing bytes":            append(utf8Seq("c1", "n"), 0x00),
		"bad node":                  utf8Seq("c1", "NODE_A"),
		"printable, not UTF8String": printable,
		"empty":                     {},
	} {
		_, err := nodebind.FromCertificate(certWith(t, bad(v)))
		require.Error(t, err, name)
		require.False(t, errors.Is(err, nodebind.ErrAbsent), name)
	}
}
