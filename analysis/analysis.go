package analysis

import (
	"cmp"
	"errors"
	"fmt"
	"path"
	"slices"
	"strings"

	"github.com/isthmus-mesh/isthmus/analysis/msg"
)

// Analyzer is one check. Analyze must only read the snapshot; analyzers
// run one after another.
type Analyzer interface {
	// Name is the check's short, unique name.
	Name() string
	// Analyze returns the check's findings on s.
	Analyze(s *Snapshot) []msg.Message
}

// Suppression silences the messages of one code about the resources its
// pattern matches.
type Suppression struct {
	// Code is a catalogue code (ISM0001...).
	Code string
	// Resource is Kind/Namespace/Name (Kind/Name without a namespace) in
	// which each `*` matches one segment or part of one; a lone `*`
	// matches every resource.
	Resource string
}

// ParseSuppression parses CODE=Kind/ns/name (the --suppress form).
func ParseSuppression(s string) (Suppression, error) {
	code, res, ok := strings.Cut(s, "=")
	code, res = strings.TrimSpace(code), strings.TrimSpace(res)
	if !ok || code == "" || res == "" {
		return Suppression{}, fmt.Errorf("suppression %q: want CODE=Kind/namespace/name", s)
	}
	if _, known := msg.ByCode(code); !known {
		return Suppression{}, fmt.Errorf("suppression %q: unknown code %s", s, code)
	}
	if _, err := path.Match(res, ""); err != nil {
		return Suppression{}, fmt.Errorf("suppression %q: bad pattern: %w", s, err)
	}
	return Suppression{Code: code, Resource: res}, nil
}

// Matches reports whether the suppression silences m.
func (s Suppression) Matches(m msg.Message) bool {
	if m.Type.Code != s.Code {
		return false
	}
	if s.Resource == "*" {
		return true
	}
	ok, _ := path.Match(s.Resource, m.Resource.String())
	return ok
}

// Run runs every analyzer on s and returns their messages without the
// suppressed ones and duplicates, the most serious first, then by code,
// resource and text. An analyzer that panics is reported as an error
// naming it; the others still run.
func Run(s *Snapshot, analyzers []Analyzer, suppress []Suppression) ([]msg.Message, error) {
	var out []msg.Message
	var errs []error
	for _, a := range analyzers {
		msgs, err := runOne(a, s)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, m := range msgs {
			if !slices.ContainsFunc(suppress, func(sup Suppression) bool { return sup.Matches(m) }) {
				out = append(out, m)
			}
		}
	}
	slices.SortFunc(out, compareMessages)
	out = slices.CompactFunc(out, func(a, b msg.Message) bool { return compareMessages(a, b) == 0 })
	return out, errors.Join(errs...)
}

func runOne(a Analyzer, s *Snapshot) (msgs []msg.Message, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("analyzer %s failed: %v", a.Name(), r)
		}
	}()
	return a.Analyze(s), nil
}

func compareMessages(a, b msg.Message) int {
	return cmp.Or(
		cmp.Compare(b.Type.Level, a.Type.Level),
		cmp.Compare(a.Type.Code, b.Type.Code),
		cmp.Compare(a.Resource.String(), b.Resource.String()),
		cmp.Compare(a.Resource.Cluster, b.Resource.Cluster),
		cmp.Compare(a.Text(), b.Text()),
	)
}

// Fails reports whether any message is at or above threshold (the
// --failure-threshold rule).
func Fails(msgs []msg.Message, threshold msg.Level) bool {
	return slices.ContainsFunc(msgs, func(m msg.Message) bool { return m.Type.Level >= threshold })
}
