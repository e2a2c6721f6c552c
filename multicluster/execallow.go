package multicluster

import (
	"errors"
	"fmt"
	"path"
	"path/filepath"
	"slices"
	"strings"

	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"
)

// ExecRule allows remote kubeconfigs to run one exec credential plugin
// with one shape of arguments and a set of environment variables. A
// kubeconfig's exec is allowed when some rule allows all three.
//
// The file format (ParseExecAllowlist) and the flag format (ParseExecRule)
// are YAML or JSON with these field names.
type ExecRule struct {
	// Command is the plugin's absolute, clean path. The kubeconfig's
	// exec.command must be exactly this string: no PATH lookup, no
	// relative path.
	Command string `json:"command"`
	// Args holds one pattern per argument: the kubeconfig's exec.args must
	// have exactly as many arguments, each matching its pattern. A pattern
	// is a path.Match glob (* any run of characters but '/', ? one
	// character but '/', [...] a class, \ escapes); one without those
	// characters matches only itself. A pattern that does not start with
	// '-' never matches an argument that does, so a wildcard cannot inject
	// a flag. No Args: the plugin runs without arguments.
	Args []string `json:"args,omitempty"`
	// Env lists the environment variable names the kubeconfig's exec.env
	// may set (values come from the kubeconfig). Nothing else of pilot's
	// environment reaches the plugin; KUBERNETES_EXEC_INFO is always set.
	Env []string `json:"env,omitempty"`
}

// execAllowlistFile is the file format: {"commands": [rule, ...]}.
type execAllowlistFile struct {
	Commands []ExecRule `json:"commands"`
}

// ParseExecAllowlist parses an allowlist file (YAML or JSON):
//
//	commands:
//	- command: /usr/local/bin/token-plugin
//	  args: [get-token, --cluster, "prod-*"]
//	  env: [PLUGIN_PROFILE]
//
// Unknown fields are errors, so a misspelt key never widens or narrows
// the list silently. Every rule is validated.
func ParseExecAllowlist(data []byte) ([]ExecRule, error) {
	var f execAllowlistFile
	if err := yaml.UnmarshalStrict(data, &f); err != nil {
		return nil, fmt.Errorf("exec allowlist: %w", err)
	}
	if err := validateExecRules(f.Commands); err != nil {
		return nil, err
	}
	return f.Commands, nil
}

// ParseExecRule parses one rule written as a YAML flow mapping or a JSON
// object, e.g. `{command: /usr/local/bin/token-plugin, args: [get-token, "*"], env: [PLUGIN_PROFILE]}`
// (pilot's --exec-allow).
func ParseExecRule(spec string) (ExecRule, error) {
	var r ExecRule
	if err := yaml.UnmarshalStrict([]byte(spec), &r); err != nil {
		return ExecRule{}, fmt.Errorf("exec rule: %w", err)
	}
	if err := r.validate(); err != nil {
		return ExecRule{}, err
	}
	return r, nil
}

// reservedEnv can never be allowed: KUBERNETES_EXEC_INFO is the protocol's
// own, and the dynamic loader's variables would let the writer of a Secret
// load code into the plugin.
func reservedEnv(name string) bool {
	return name == execInfoEnv || strings.HasPrefix(name, "LD_") || strings.HasPrefix(name, "DYLD_") || name == "GCONV_PATH"
}

func validateExecRules(rules []ExecRule) error {
	var errs []error
	for i, r := range rules {
		if err := r.validate(); err != nil {
			errs = append(errs, fmt.Errorf("rule %d: %w", i, err))
		}
	}
	return errors.Join(errs...)
}

func (r ExecRule) validate() error {
	if !filepath.IsAbs(r.Command) || filepath.Clean(r.Command) != r.Command {
		return fmt.Errorf("exec rule: command %q must be an absolute, clean path", r.Command)
	}
	for i, p := range r.Args {
		if _, err := path.Match(p, ""); err != nil {
			return fmt.Errorf("exec rule %s: argument pattern %d %q: %w", r.Command, i, p, err)
		}
	}
	for _, n := range r.Env {
		if n == "" || strings.ContainsAny(n, "=\x00") {
			return fmt.Errorf("exec rule %s: %q is not an environment variable name", r.Command, n)
		}
		if reservedEnv(n) {
			return fmt.Errorf("exec rule %s: environment variable %s may not be allowed", r.Command, n)
		}
	}
	return nil
}

// checkExec decides whether rules allow exec. The error says what did not
// match (the first mismatch of the rule that came closest); it names
// the kubeconfig's command, argument positions and variable names, never
// the arguments' or the variables' values (they may hold secrets).
func checkExec(rules []ExecRule, exec *clientcmdapi.ExecConfig) error {
	notAllowed := func(format string, a ...any) error {
		return &KubeconfigError{ReasonExecNotAllowed, fmt.Sprintf(format, a...)}
	}
	if !filepath.IsAbs(exec.Command) {
		return notAllowed("exec command %q is not an absolute path; only allowlisted absolute paths run", exec.Command)
	}
	if len(rules) == 0 {
		return notAllowed("exec command %s: no exec plugin is allowed (pilot --exec-allowlist / --exec-allow)", exec.Command)
	}
	seen := map[string]bool{}
	for _, e := range exec.Env {
		if seen[e.Name] {
			return notAllowed("exec command %s: environment variable %s is set twice", exec.Command, e.Name)
		}
		seen[e.Name] = true
	}
	var closest error
	best := -1
	for _, r := range rules {
		if r.Command != exec.Command {
			continue
		}
		depth, err := r.match(exec)
		if err == nil {
			return nil
		}
		if depth > best {
			best, closest = depth, err
		}
	}
	if closest == nil {
		return notAllowed("exec command %s is not on the allowlist", exec.Command)
	}
	return notAllowed("exec command %s: %v", exec.Command, closest)
}

// match reports the first way exec falls outside r, and how far it got
// (so that the error of the rule that came closest is the one reported).
func (r ExecRule) match(exec *clientcmdapi.ExecConfig) (int, error) {
	if len(exec.Args) != len(r.Args) {
		return 0, fmt.Errorf("%d arguments given, the allowlist entry takes %d", len(exec.Args), len(r.Args))
	}
	for i, a := range exec.Args {
		if !matchArg(r.Args[i], a) {
			return 1 + i, fmt.Errorf("argument %d does not match the allowed pattern %q", i, r.Args[i])
		}
	}
	for _, e := range exec.Env {
		if !slices.Contains(r.Env, e.Name) {
			return 1 + len(r.Args), fmt.Errorf("environment variable %s is not allowed", e.Name)
		}
	}
	return 0, nil
}

func matchArg(pattern, arg string) bool {
	if strings.HasPrefix(arg, "-") && !strings.HasPrefix(pattern, "-") {
		return false
	}
	ok, err := path.Match(pattern, arg)
	return err == nil && ok
}
