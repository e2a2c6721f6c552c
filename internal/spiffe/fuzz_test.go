package spiffe

import "testing"

// FuzzParse: whatever Parse accepts is a workload identity spelled exactly
// as its String (one spelling per identity, so identities compare as
// strings), a valid SPIFFE ID (ID succeeds) that parses back to the same
// identity, and the string form of its URL.
func FuzzParse(f *testing.F) {
	f.Fuzz(func(t *testing.T, s string) {
		id, err := Parse(s)
		if err != nil {
			if !id.IsZero() {
				t.Fatalf("%q refused (%v) yet returned %+v", s, err, id)
			}
			return
		}
		if id.IsZero() || id.Namespace == "" || id.ServiceAccount == "" {
			t.Fatalf("%q parsed as %+v", s, id)
		}
		str := id.String()
		if str != s {
			t.Fatalf("%q parsed as %+v, which prints as %q", s, id, str)
		}
		again, err := Parse(str)
		if err != nil || again != id {
			t.Fatalf("%q parsed as %+v, printed as %q, re-parsed as %+v (%v)", s, id, str, again, err)
		}
		sid, err := id.ID()
		if err != nil || sid.String() != str || id.URL().String() != str {
			t.Fatalf("%+v: ID %q (%v), URL %q, String %q", id, sid, err, id.URL(), str)
		}
		if byURL, err := FromURI(id.URL()); err != nil || byURL != id {
			t.Fatalf("%+v: FromURI gives %+v (%v)", id, byURL, err)
		}
	})
}

// FuzzParseTrustBundle: a trust bundle map is untrusted input to ztunnel
// (a file anyone with write access to the ConfigMap could shape). Whatever
// ParseTrustBundle accepts trusts only valid domains, each with at least
// one CA root, and marshals to a document that parses back to an equal
// bundle; nothing panics.
func FuzzParseTrustBundle(f *testing.F) {
	f.Add([]byte(`{"trust_domains": {}}`))
	f.Add([]byte(`{"trust_domains": {"a.example": {"keys": []}}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := ParseTrustBundle(data)
		if err != nil {
			return
		}
		for _, td := range b.Domains() {
			if ValidateTrustDomain(td) != nil || len(b.Roots(td)) == 0 {
				t.Fatalf("accepted domain %q with %d roots", td, len(b.Roots(td)))
			}
			for _, r := range b.Roots(td) {
				if !r.IsCA {
					t.Fatalf("domain %q trusts a non-CA certificate", td)
				}
			}
		}
		out, err := b.Marshal()
		if err != nil {
			t.Fatalf("marshal an accepted bundle: %v", err)
		}
		again, err := ParseTrustBundle(out)
		if err != nil || !again.Equal(b) {
			t.Fatalf("re-parse of %s: %v", out, err)
		}
	})
}
