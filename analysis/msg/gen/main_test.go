package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestGeneratedFilesAreFresh fails when messages.gen.go or the catalogue
// section of docs/analyzers.md differ from what the generator makes of
// messages.yaml now: run `make generate` and commit.
func TestGeneratedFilesAreFresh(t *testing.T) {
	root, err := moduleRoot()
	require.NoError(t, err)
	files, err := generate(root)
	require.NoError(t, err)
	require.Len(t, files, 2)
	for path, want := range files {
		got, err := os.ReadFile(filepath.Join(root, path))
		require.NoError(t, err)
		if line, ok := firstDifference(string(want), string(got)); !ok {
			t.Errorf("%s is stale (line %d differs): run `make generate`", path, line)
		}
	}
}

// TestCatalogueValidation checks that the generator refuses catalogues an
// analyzer could not use.
func TestCatalogueValidation(t *testing.T) {
	const ok = `messages:
- name: A
  code: ISM0001
  level: Error
  description: d
  template: "x %s"
  args: [{name: a, type: string}]
`
	_, err := parseCatalogue([]byte(ok))
	require.NoError(t, err)
	for name, tc := range map[string]struct{ from, to, want string }{
		"bad code":       {"ISM0001", "IST0001", "is not ISM"},
		"bad level":      {"level: Error", "level: Fatal", "level"},
		"verb count":     {`"x %s"`, `"x %s %d"`, "2 verbs for 1 args"},
		"bad arg type":   {"type: string", "type: float", "want string or int"},
		"exported arg":   {"name: a,", "name: A,", "unexported"},
		"no description": {"description: d", `description: ""`, "no description"},
		"unknown field":  {"level: Error", "level: Error\n  extra: 1", "unknown field"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := parseCatalogue([]byte(strings.Replace(ok, tc.from, tc.to, 1)))
			require.ErrorContains(t, err, tc.want)
		})
	}
	dup := ok + strings.Replace(strings.TrimPrefix(ok, "messages:\n"), "name: A\n", "name: B\n", 1)
	_, err = parseCatalogue([]byte(dup))
	require.ErrorContains(t, err, "duplicate code")
}

// firstDifference returns the first line (from 1) where a and b differ,
// and whether they are equal.
func firstDifference(a, b string) (int, bool) {
	if a == b {
		return 0, true
	}
	al, bl := strings.Split(a, "\n"), strings.Split(b, "\n")
	for i := range min(len(al), len(bl)) {
		if al[i] != bl[i] {
			return i + 1, false
		}
	}
	return min(len(al), len(bl)) + 1, false
}
