package xds

// byType maps type URLs to values, in a slice. A stream uses a few types
// (two to five), and a Go map costs a group of 8 slots, 200 to 330 bytes,
// from its first entry: a stream held four such maps, a kilobyte per idle
// client. A lookup compares a few strings. Unknown types end a stream
// after its first request, so the slice stays as short as the types served.
type byType[V any] []typed[V]

type typed[V any] struct {
	typeURL string
	v       V
}

// get returns the value of typeURL, or V's zero value.
func (m byType[V]) get(typeURL string) V {
	for i := range m {
		if m[i].typeURL == typeURL {
			return m[i].v
		}
	}
	var zero V
	return zero
}

// set sets the value of typeURL.
func (m *byType[V]) set(typeURL string, v V) {
	for i := range *m {
		if (*m)[i].typeURL == typeURL {
			(*m)[i].v = v
			return
		}
	}
	*m = append(*m, typed[V]{typeURL: typeURL, v: v})
}
