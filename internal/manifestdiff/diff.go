// Package manifestdiff compares two sets of rendered Kubernetes manifests
// object by object (identity: API group, kind, namespace, name) and
// describes each difference as field paths with their old and new values.
package manifestdiff

import (
	"cmp"
	"fmt"
	"maps"
	"slices"

	"github.com/isthmus-mesh/isthmus/internal/kubeyaml"
)

// Options narrows and maps the comparison.
type Options struct {
	// Select, when set, keeps only objects matching one of the patterns
	// (by their ID in either set).
	Select []Pattern
	// Ignore drops objects matching one of the patterns (in either set).
	Ignore []Pattern
	// Renames map objects of the first set to their ID in the second; the
	// first matching rename applies.
	Renames []Rename
}

// Change is one field that differs: at Path, Old in the first set and New
// in the second (Missing when absent there).
type Change struct {
	Path       string
	Old, New   any
	OldMissing bool
	NewMissing bool
}

// ObjectDiff is an object present in both sets that differs.
type ObjectDiff struct {
	// ID is the object's ID in the second set; From its ID in the first
	// (different when renamed).
	ID, From ID
	Changes  []Change
}

// Result is the comparison of two sets.
type Result struct {
	// Changed lists the objects in both sets that differ, by ID.
	Changed []ObjectDiff
	// Added are only in the second set; Removed only in the first.
	Added, Removed []ID
	// Compared counts the objects found in both sets.
	Compared int
}

// Equal reports whether the sets have no difference.
func (r *Result) Equal() bool {
	return len(r.Changed) == 0 && len(r.Added) == 0 && len(r.Removed) == 0
}

type entry struct {
	obj  kubeyaml.Object
	from ID // ID in its own set, before renames
}

// Compare compares the objects of the first set a with those of the
// second set b. An object appearing twice in one set is an error naming
// both places.
func Compare(a, b []kubeyaml.Object, opts Options) (*Result, error) {
	left, err := index(a, opts.Renames)
	if err != nil {
		return nil, fmt.Errorf("first set: %w", err)
	}
	right, err := index(b, nil)
	if err != nil {
		return nil, fmt.Errorf("second set: %w", err)
	}
	keep := func(ids ...ID) bool {
		for _, id := range ids {
			if slices.ContainsFunc(opts.Ignore, func(p Pattern) bool { return p.Matches(id) }) {
				return false
			}
		}
		if len(opts.Select) == 0 {
			return true
		}
		for _, id := range ids {
			if slices.ContainsFunc(opts.Select, func(p Pattern) bool { return p.Matches(id) }) {
				return true
			}
		}
		return false
	}
	res := &Result{}
	ids := slices.Collect(maps.Keys(left))
	for id := range right {
		if _, ok := left[id]; !ok {
			ids = append(ids, id)
		}
	}
	slices.SortFunc(ids, func(x, y ID) int { return cmp.Compare(x.String(), y.String()) })
	for _, id := range ids {
		l, inLeft := left[id]
		r, inRight := right[id]
		switch {
		case !inRight:
			if keep(id, l.from) {
				res.Removed = append(res.Removed, l.from)
			}
		case !inLeft:
			if keep(id) {
				res.Added = append(res.Added, id)
			}
		case keep(id, l.from):
			res.Compared++
			if changes := diffObjects(l.obj.Object, r.obj.Object); len(changes) > 0 {
				res.Changed = append(res.Changed, ObjectDiff{ID: id, From: l.from, Changes: changes})
			}
		}
	}
	return res, nil
}

// index maps each object's ID (renamed) to it.
func index(objs []kubeyaml.Object, renames []Rename) (map[ID]entry, error) {
	out := make(map[ID]entry, len(objs))
	for _, o := range objs {
		gvk := o.GroupVersionKind()
		own := ID{Group: gvk.Group, Kind: gvk.Kind, Namespace: o.GetNamespace(), Name: o.GetName()}
		if own.Name == "" {
			return nil, fmt.Errorf("%s: %s without metadata.name", o.Source, gvk.Kind)
		}
		id := own
		for _, r := range renames {
			if renamed, ok := r.apply(own); ok {
				id = renamed
				break
			}
		}
		if prev, dup := out[id]; dup {
			return nil, fmt.Errorf("%s appears twice: %s and %s", id, prev.obj.Source, o.Source)
		}
		out[id] = entry{obj: o, from: own}
	}
	return out, nil
}
