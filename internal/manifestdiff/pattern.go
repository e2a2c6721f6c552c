package manifestdiff

import (
	"fmt"
	"path"
	"strings"
)

// ID identifies an object across two manifest sets: its API group (not
// its version: apps/v1 and apps/v1beta1 name the same object), kind,
// namespace and name.
type ID struct {
	Group, Kind, Namespace, Name string
}

// String is Kind:Namespace:Name, the Kind qualified by its group
// (Kind.group) outside the core group; the namespace is empty for
// cluster-scoped objects.
func (id ID) String() string {
	kind := id.Kind
	if id.Group != "" {
		kind += "." + id.Group
	}
	return kind + ":" + id.Namespace + ":" + id.Name
}

// Pattern matches IDs: Kind:Namespace:Name where each part may hold `*`
// (any run of characters, empty included). The Kind part matches the kind
// alone or Kind.group.
type Pattern struct {
	Kind, Namespace, Name string
}

// ParsePattern parses Kind:Namespace:Name.
func ParsePattern(s string) (Pattern, error) {
	parts := strings.Split(strings.TrimSpace(s), ":")
	if len(parts) != 3 || parts[0] == "" || parts[2] == "" {
		return Pattern{}, fmt.Errorf("pattern %q: want Kind:Namespace:Name (use * as a wildcard, an empty namespace for cluster-scoped objects)", s)
	}
	for _, p := range parts {
		if _, err := path.Match(p, ""); err != nil {
			return Pattern{}, fmt.Errorf("pattern %q: %w", s, err)
		}
	}
	return Pattern{parts[0], parts[1], parts[2]}, nil
}

// ParsePatterns parses a comma-separated list of patterns.
func ParsePatterns(s string) ([]Pattern, error) {
	var out []Pattern
	for p := range strings.SplitSeq(s, ",") {
		if strings.TrimSpace(p) == "" {
			continue
		}
		pat, err := ParsePattern(p)
		if err != nil {
			return nil, err
		}
		out = append(out, pat)
	}
	return out, nil
}

func (p Pattern) String() string { return p.Kind + ":" + p.Namespace + ":" + p.Name }

// Matches reports whether id matches the pattern.
func (p Pattern) Matches(id ID) bool {
	kindOK := glob(p.Kind, id.Kind) || (id.Group != "" && glob(p.Kind, id.Kind+"."+id.Group))
	return kindOK && glob(p.Namespace, id.Namespace) && glob(p.Name, id.Name)
}

// glob matches s against a pattern whose only special character is `*`.
func glob(pattern, s string) bool {
	if !strings.Contains(pattern, "*") {
		return pattern == s
	}
	ok, _ := path.Match(escapeExceptStar(pattern), s)
	return ok
}

// escapeExceptStar escapes path.Match's other special characters.
func escapeExceptStar(p string) string {
	var b strings.Builder
	for _, r := range p {
		if r == '?' || r == '[' || r == '\\' {
			b.WriteRune('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// Rename maps objects of the first set matching From to the ID they have
// in the second set: a To part that is `*` keeps the object's own value,
// any other To part replaces it.
type Rename struct {
	From, To Pattern
}

// ParseRenames parses comma-separated Old->New pairs.
func ParseRenames(s string) ([]Rename, error) {
	var out []Rename
	for pair := range strings.SplitSeq(s, ",") {
		if strings.TrimSpace(pair) == "" {
			continue
		}
		from, to, ok := strings.Cut(pair, "->")
		if !ok {
			return nil, fmt.Errorf("rename %q: want Old->New (Kind:Namespace:Name each)", pair)
		}
		f, err := ParsePattern(from)
		if err != nil {
			return nil, fmt.Errorf("rename %q: %w", pair, err)
		}
		t, err := ParsePattern(to)
		if err != nil {
			return nil, fmt.Errorf("rename %q: %w", pair, err)
		}
		for _, part := range []string{t.Kind, t.Namespace, t.Name} {
			if part != "*" && strings.Contains(part, "*") {
				return nil, fmt.Errorf("rename %q: a New part is either * (kept) or has no wildcard", pair)
			}
		}
		out = append(out, Rename{f, t})
	}
	return out, nil
}

// apply returns id renamed, and whether From matched.
func (r Rename) apply(id ID) (ID, bool) {
	if !r.From.Matches(id) {
		return id, false
	}
	out := id
	if r.To.Kind != "*" {
		kind, group, _ := strings.Cut(r.To.Kind, ".")
		out.Kind = kind
		if group != "" {
			out.Group = group
		}
	}
	if r.To.Namespace != "*" {
		out.Namespace = r.To.Namespace
	}
	if r.To.Name != "*" {
		out.Name = r.To.Name
	}
	return out, true
}
