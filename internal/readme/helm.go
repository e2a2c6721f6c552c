package readme

import (
	"errors"
	"fmt"
	"strings"

	"helm.sh/helm/v3/pkg/strvals"
)

// Helm is one `helm install` line of a README:
//
//	helm [--kube-context C] install <release> <chart> [-n|--namespace NS] [--create-namespace] [--set k=v]...
type Helm struct {
	// Line is the command as the README has it (continuations joined).
	Line string
	// KubeContext is --kube-context (empty: the current context).
	KubeContext string
	// Release and Chart are the positional arguments; Chart is the path the
	// README gives (e.g. manifests/pilot).
	Release, Chart string
	// Namespace is -n/--namespace (empty: "default", as helm).
	Namespace string
	// CreateNamespace is --create-namespace.
	CreateNamespace bool
	// Sets are the --set expressions, in order.
	Sets []string
}

// ParseHelm parses a `helm install` line. Any other verb, a flag it does not
// know or a --set that strvals cannot parse is an error naming the line: a
// README line no test understands must not pass unseen.
func ParseHelm(line string) (Helm, error) {
	args := strings.Fields(line)
	h := Helm{Line: line}
	if len(args) == 0 || args[0] != "helm" {
		return h, fmt.Errorf("not a helm command: %q", line)
	}
	var pos []string
	for i := 1; i < len(args); i++ {
		a := args[i]
		flag, val, inline := strings.Cut(a, "=")
		if !strings.HasPrefix(a, "-") {
			pos = append(pos, a)
			continue
		}
		needsValue := flag == "--kube-context" || flag == "-n" || flag == "--namespace" || flag == "--set"
		if needsValue && !inline {
			if i+1 >= len(args) {
				return h, fmt.Errorf("%s without a value: %q", a, line)
			}
			i++
			val = args[i]
		}
		switch flag {
		case "--kube-context":
			h.KubeContext = val
		case "-n", "--namespace":
			h.Namespace = val
		case "--set":
			if _, err := strvals.Parse(val); err != nil {
				return h, fmt.Errorf("--set %s: %w (%q)", val, err, line)
			}
			h.Sets = append(h.Sets, val)
		case "--create-namespace":
			if inline {
				return h, fmt.Errorf("--create-namespace takes no value: %q", line)
			}
			h.CreateNamespace = true
		default:
			return h, fmt.Errorf("helm flag %s not understood: %q", a, line)
		}
	}
	if len(pos) != 3 || pos[0] != "install" {
		return h, fmt.Errorf("want helm install <release> <chart>, got %v: %q", pos, line)
	}
	h.Release, h.Chart = pos[1], pos[2]
	return h, nil
}

// Values merges the --set expressions into one values map, as helm does.
func (h Helm) Values() (map[string]any, error) {
	vals := map[string]any{}
	var errs []error
	for _, s := range h.Sets {
		if err := strvals.ParseInto(s, vals); err != nil {
			errs = append(errs, fmt.Errorf("--set %s: %w", s, err))
		}
	}
	return vals, errors.Join(errs...)
}

// Set returns the scalar value the line's last --set gives key (in a
// "key=value[,key2=value2]" expression), and whether one does. It is for
// scalar keys such as image.registry: a list value ({a,b}) is not
// reassembled.
func (h Helm) Set(key string) (string, bool) {
	val, ok := "", false
	for _, s := range h.Sets {
		for _, kv := range strings.Split(s, ",") {
			if k, v, found := strings.Cut(kv, "="); found && k == key {
				val, ok = v, true
			}
		}
	}
	return val, ok
}
