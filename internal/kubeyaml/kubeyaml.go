// Package kubeyaml reads Kubernetes objects from files and folders of
// multi-document YAML (or JSON), as rendered manifests and `kubectl get -o
// yaml` output come: each object with the file and document it came from.
package kubeyaml

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// Object is one decoded object and where it came from.
type Object struct {
	*unstructured.Unstructured
	// Source is "file:document" (documents counted from 1).
	Source string
}

// Extensions of the files a folder is read for.
var Extensions = []string{".yaml", ".yml", ".json"}

// Load reads the objects of every path: a file, or a folder whose files
// with one of Extensions are read recursively in lexical order. Empty
// documents are skipped; a `kind: List` (or any *List kind with items) is
// expanded into its items. Any document that is not a Kubernetes object is
// an error naming its file and document.
func Load(paths ...string) ([]Object, error) {
	var out []Object
	for _, p := range paths {
		files, err := Files(p)
		if err != nil {
			return nil, err
		}
		for _, f := range files {
			objs, err := LoadFile(f)
			if err != nil {
				return nil, err
			}
			out = append(out, objs...)
		}
	}
	return out, nil
}

// Files returns path itself when it is a file, else the files under the
// folder path with one of Extensions, sorted.
func Files(path string) ([]string, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if !st.IsDir() {
		return []string{path}, nil
	}
	var files []string
	err = filepath.WalkDir(path, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && slices.Contains(Extensions, strings.ToLower(filepath.Ext(p))) {
			files = append(files, p)
		}
		return nil
	})
	slices.Sort(files)
	return files, err
}

// LoadFile reads the objects of one file.
func LoadFile(path string) ([]Object, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return Decode(f, path)
}

// Decode reads the objects of a multi-document YAML or JSON stream; name
// prefixes each object's Source.
func Decode(r io.Reader, name string) ([]Object, error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(r))
	var out []Object
	for doc := 1; ; doc++ {
		raw, err := reader.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", name, doc, err)
		}
		if len(bytes.TrimSpace(raw)) == 0 {
			continue
		}
		m := map[string]any{}
		if err := yaml.Unmarshal(raw, &m); err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", name, doc, err)
		}
		if len(m) == 0 {
			continue // only comments
		}
		src := fmt.Sprintf("%s:%d", name, doc)
		u := &unstructured.Unstructured{Object: m}
		if u.GetKind() == "" || u.GetAPIVersion() == "" {
			return nil, fmt.Errorf("%s: not a Kubernetes object (no apiVersion or kind)", src)
		}
		if !u.IsList() {
			out = append(out, Object{u, src})
			continue
		}
		list, err := u.ToList()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", src, err)
		}
		for i := range list.Items {
			out = append(out, Object{&list.Items[i], fmt.Sprintf("%s[%d]", src, i)})
		}
	}
}
