package multicluster

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"regexp"
	"strings"
	"time"
	"unicode"

	clientauthv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// execInfoEnv carries the ExecCredential request to a plugin.
const execInfoEnv = "KUBERNETES_EXEC_INFO"

// Bounds of one plugin run.
const (
	maxExecStdout     = 64 << 10 // an ExecCredential with a certificate chain is a few KB
	maxExecStderr     = 4 << 10  // kept for the excerpt only
	execStderrExcerpt = 200      // characters of redacted stderr in the log
	execWaitDelay     = time.Second
)

// ExecConfig configures the exec credential plugins of remote kubeconfigs.
type ExecConfig struct {
	// Allowlist lists the plugins remote kubeconfigs may run; an exec
	// kubeconfig no rule allows is refused with ReasonExecNotAllowed.
	Allowlist []ExecRule
	// Timeout bounds one run of a plugin (default 10 s); when it ends the
	// plugin's process group is killed.
	Timeout time.Duration
}

// ExecError says why an exec credential plugin gave no usable credential.
// It never holds a credential or the plugin's output.
type ExecError struct {
	// Command is the plugin's path.
	Command string
	// Detail says what went wrong.
	Detail string
	// result is the metric label of the failure.
	result string
}

func (e *ExecError) Error() string { return "exec credential plugin " + e.Command + ": " + e.Detail }

var errExecTimeout = errors.New("exec plugin timed out")

// execPlugin is one allowed plugin invocation: the command, its arguments,
// and the whole environment it gets.
type execPlugin struct {
	command    string
	args       []string
	env        []string
	apiVersion string
	timeout    time.Duration
}

// newExecPlugin prepares ex (already allowed by the sanitizer) for cluster
// cl: the environment is the kubeconfig's variables and the ExecCredential
// request, nothing of pilot's own.
func newExecPlugin(ex *clientcmdapi.ExecConfig, cl *clientcmdapi.Cluster, timeout time.Duration) (*execPlugin, error) {
	req := clientauthv1.ExecCredential{}
	req.APIVersion, req.Kind = ex.APIVersion, "ExecCredential"
	if ex.ProvideClusterInfo {
		req.Spec.Cluster = &clientauthv1.Cluster{
			Server: cl.Server, TLSServerName: cl.TLSServerName, InsecureSkipTLSVerify: cl.InsecureSkipTLSVerify,
			CertificateAuthorityData: cl.CertificateAuthorityData, ProxyURL: cl.ProxyURL, DisableCompression: cl.DisableCompression,
		}
	}
	info, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("exec request: %w", err)
	}
	env := make([]string, 0, len(ex.Env)+1)
	for _, e := range ex.Env {
		env = append(env, e.Name+"="+e.Value)
	}
	env = append(env, execInfoEnv+"="+string(info))
	return &execPlugin{command: ex.Command, args: ex.Args, env: env, apiVersion: ex.APIVersion, timeout: timeout}, nil
}

// run runs the plugin once, without a shell or a terminal, in "/", with
// its clean environment and the timeout, and returns its credential. The
// excerpt is a redacted, bounded sample of what the plugin wrote to stderr
// (for the log, never for the cluster's status).
func (p *execPlugin) run(ctx context.Context, now func() time.Time) (cred *execCredential, excerpt string, err error) {
	ctx, cancel := context.WithTimeoutCause(ctx, p.timeout, errExecTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, p.command, p.args...)
	cmd.Env = p.env // never nil: a nil Env would inherit pilot's environment
	cmd.Dir = "/"
	stdout, stderr := &boundedBuffer{max: maxExecStdout}, &boundedBuffer{max: maxExecStderr}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	cmd.WaitDelay = execWaitDelay
	inProcessGroup(cmd)
	runErr := cmd.Run()
	killProcessGroup(cmd)
	excerpt = stderrExcerpt(stderr.buf)
	fail := func(result, format string, a ...any) (*execCredential, string, error) {
		return nil, excerpt, &ExecError{Command: p.command, Detail: fmt.Sprintf(format, a...), result: result}
	}
	switch {
	case runErr != nil && context.Cause(ctx) == errExecTimeout:
		return fail("timeout", "timed out after %s (process group killed)", p.timeout)
	case runErr != nil && ctx.Err() != nil:
		return fail("failed", "stopped: the cluster is closing")
	case runErr != nil:
		var exitErr *exec.ExitError
		if errors.As(runErr, &exitErr) {
			return fail("failed", "%s (stderr: %d bytes, a redacted excerpt is in pilot's log)", exitErr.ProcessState, stderr.total)
		}
		return fail("failed", "cannot run: %s", firstLine(runErr.Error(), 200))
	case stdout.total > maxExecStdout:
		return fail("invalid", "wrote %d bytes to stdout, more than the %d an ExecCredential may take", stdout.total, maxExecStdout)
	}
	cred, err = parseExecCredential(stdout.buf, p.apiVersion, now())
	if err != nil {
		return fail("invalid", "%v", err)
	}
	return cred, excerpt, nil
}

// execCredential is one credential a plugin returned. Its fields are fixed
// once made, except rejected (guarded by the execAuth's mutex).
type execCredential struct {
	token     string
	cert      *tls.Certificate
	obtained  time.Time
	expiry    time.Time // zero: valid until rejected
	refreshAt time.Time // zero: never refreshed unless rejected
	rejected  bool
}

// usable reports whether c may be sent at now.
func (c *execCredential) usable(now time.Time) bool {
	return !c.rejected && (c.expiry.IsZero() || now.Before(c.expiry))
}

// due reports whether a fresh credential should be asked for at now.
func (c *execCredential) due(now time.Time) bool {
	return c.rejected || (!c.refreshAt.IsZero() && !now.Before(c.refreshAt))
}

// refreshMargin is how long before its expiry a credential is refreshed: a
// fifth of its lifetime, at most five minutes.
func refreshMargin(lifetime time.Duration) time.Duration {
	return min(lifetime/5, 5*time.Minute)
}

// parseExecCredential validates a plugin's output: an ExecCredential of
// apiVersion with a status holding a token, or a client certificate and
// its key (or both), and, if given, an expiry in the future. Errors never
// quote the output.
func parseExecCredential(out []byte, apiVersion string, now time.Time) (*execCredential, error) {
	var ec clientauthv1.ExecCredential
	dec := json.NewDecoder(bytes.NewReader(out))
	if err := dec.Decode(&ec); err != nil {
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return nil, fmt.Errorf("output is not JSON (syntax error at byte %d)", se.Offset)
		}
		return nil, fmt.Errorf("output is not an ExecCredential: %s", firstLine(err.Error(), 160))
	}
	if dec.More() {
		return nil, errors.New("output holds more than one JSON value")
	}
	switch {
	case ec.Kind != "ExecCredential":
		return nil, errors.New("output kind is not ExecCredential")
	case ec.APIVersion != apiVersion:
		return nil, fmt.Errorf("output apiVersion is not %s, the kubeconfig's", apiVersion)
	case ec.Status == nil:
		return nil, errors.New("output has no status")
	}
	st := ec.Status
	c := &execCredential{token: st.Token, obtained: now}
	if st.Token == "" && st.ClientCertificateData == "" && st.ClientKeyData == "" {
		return nil, errors.New("status has neither a token nor a client certificate")
	}
	for _, r := range st.Token {
		if r <= ' ' || r > '~' {
			return nil, errors.New("status.token holds characters a bearer token may not")
		}
	}
	if st.ClientCertificateData != "" || st.ClientKeyData != "" {
		if st.ClientCertificateData == "" || st.ClientKeyData == "" {
			return nil, errors.New("status has a client certificate without its key, or a key without its certificate")
		}
		pair, err := tls.X509KeyPair([]byte(st.ClientCertificateData), []byte(st.ClientKeyData))
		if err != nil {
			return nil, fmt.Errorf("status client certificate and key are not a valid pair: %s", firstLine(err.Error(), 120))
		}
		c.cert = &pair
	}
	if st.ExpirationTimestamp != nil && !st.ExpirationTimestamp.IsZero() {
		c.expiry = st.ExpirationTimestamp.Time
		if !c.expiry.After(now) {
			return nil, fmt.Errorf("status.expirationTimestamp %s is not in the future", c.expiry.UTC().Format(time.RFC3339))
		}
		c.refreshAt = c.expiry.Add(-refreshMargin(c.expiry.Sub(now)))
	}
	return c, nil
}

// boundedBuffer keeps the first max bytes written to it and counts the
// rest. os/exec writes it from one goroutine; read it after Wait.
type boundedBuffer struct {
	max   int
	buf   []byte
	total int
}

func (b *boundedBuffer) Write(p []byte) (int, error) {
	if room := b.max - len(b.buf); room > 0 {
		b.buf = append(b.buf, p[:min(room, len(p))]...)
	}
	b.total += len(p)
	return len(p), nil
}

var (
	// Long runs of token-like characters: JWTs, base64 keys, hex secrets.
	redactLong = regexp.MustCompile(`[A-Za-z0-9+/=_.~-]{16,}`)
	// Values after words that announce a secret.
	redactNamed = regexp.MustCompile(`(?i)(token|password|passwd|secret|key|bearer|authorization|credential)s?(["']?\s*[:=]\s*|\s+)\S+`)
)

// stderrExcerpt makes what a plugin wrote to stderr fit for a log line:
// one line, printable characters only, secrets-looking words redacted,
// at most execStderrExcerpt characters.
func stderrExcerpt(b []byte) string {
	s := strings.Map(func(r rune) rune {
		if r == unicode.ReplacementChar || !unicode.IsPrint(r) {
			return ' '
		}
		return r
	}, strings.ToValidUTF8(string(b), " "))
	s = strings.Join(strings.Fields(s), " ")
	s = redactNamed.ReplaceAllString(s, "${1}${2}[redacted]")
	s = redactLong.ReplaceAllString(s, "[redacted]")
	if r := []rune(s); len(r) > execStderrExcerpt {
		s = string(r[:execStderrExcerpt]) + "…"
	}
	return s
}
