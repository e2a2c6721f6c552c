package manifestdiff

import (
	"fmt"
	"maps"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// diffObjects returns the changed leaves of two decoded objects, by path.
func diffObjects(a, b map[string]any) []Change {
	left, right := map[string]any{}, map[string]any{}
	flatten("", a, left)
	flatten("", b, right)
	paths := slices.Collect(maps.Keys(left))
	for p := range right {
		if _, ok := left[p]; !ok {
			paths = append(paths, p)
		}
	}
	slices.Sort(paths)
	var out []Change
	for _, p := range paths {
		l, inLeft := left[p]
		r, inRight := right[p]
		if inLeft && inRight && reflect.DeepEqual(l, r) {
			continue
		}
		// An emptied (or newly filled) map or list shows as its entries
		// alone, not also as the empty container.
		if (!inRight && isEmptyContainer(l) && hasChildren(right, p)) || (!inLeft && isEmptyContainer(r) && hasChildren(left, p)) {
			continue
		}
		out = append(out, Change{Path: p, Old: l, New: r, OldMissing: !inLeft, NewMissing: !inRight})
	}
	return out
}

var plainKey = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_-]*$`)

// flatten records every leaf of v under its path. Map keys join with "."
// (quoted in brackets when they hold other characters); list items of maps
// that all have a distinct string "name" are addressed as [name=x], others
// by index. Empty maps and lists are leaves.
func flatten(path string, v any, out map[string]any) {
	switch t := v.(type) {
	case map[string]any:
		if len(t) == 0 {
			out[path] = t
			return
		}
		for k, val := range t {
			flatten(joinKey(path, k), val, out)
		}
	case []any:
		if len(t) == 0 {
			out[path] = t
			return
		}
		names := itemNames(t)
		for i, val := range t {
			if names != nil {
				flatten(path+"[name="+names[i]+"]", val, out)
			} else {
				flatten(path+"["+strconv.Itoa(i)+"]", val, out)
			}
		}
	default:
		out[path] = v
	}
}

func joinKey(path, k string) string {
	if !plainKey.MatchString(k) {
		return path + "[" + strconv.Quote(k) + "]"
	}
	if path == "" {
		return k
	}
	return path + "." + k
}

// itemNames returns each item's name when every item is a map with a
// distinct, non-empty string "name"; else nil.
func itemNames(items []any) []string {
	names := make([]string, len(items))
	seen := map[string]bool{}
	for i, it := range items {
		m, ok := it.(map[string]any)
		if !ok {
			return nil
		}
		name, ok := m["name"].(string)
		if !ok || name == "" || seen[name] {
			return nil
		}
		seen[name] = true
		names[i] = name
	}
	return names
}

// formatValue renders a leaf as YAML would show it on one line.
func formatValue(v any) string {
	switch t := v.(type) {
	case string:
		return strconv.Quote(t)
	case map[string]any:
		return "{}"
	case []any:
		return "[]"
	case nil:
		return "null"
	case float64:
		return strconv.FormatFloat(t, 'f', -1, 64)
	}
	return fmt.Sprint(v)
}

func isEmptyContainer(v any) bool {
	switch t := v.(type) {
	case map[string]any:
		return len(t) == 0
	case []any:
		return len(t) == 0
	}
	return false
}

// hasChildren reports whether leaves holds a path below p.
func hasChildren(leaves map[string]any, p string) bool {
	for k := range leaves {
		if len(k) > len(p) && strings.HasPrefix(k, p) && (k[len(p)] == '.' || k[len(p)] == '[') {
			return true
		}
	}
	return false
}
