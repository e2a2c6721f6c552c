package spiffe

import "testing"

// FuzzParse: whatever Parse accepts is a workload identity whose String is
// a valid SPIFFE ID (ID succeeds) that parses back to the same identity,
// and is the string form of its URL.
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
