package agent

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/isthmus-mesh/isthmus/cni/plugin"
)

// errNoConflist: the node's network plugin has not written its
// configuration yet; the installer waits for it.
var errNoConflist = errors.New("no CNI network configuration (*.conf, *.conflist, *.json) in the directory yet")

// confExtensions are the files a container runtime reads as network
// configurations; it uses the first by name.
var confExtensions = []string{".conf", ".conflist", ".json"}

// installer keeps the plugin binary in the CNI bin directory and the
// plugin's entry at the end of the node's conflist, repairing either when
// it changes or disappears.
type installer struct {
	binSrc, binDir, confDir string
	entry                   map[string]any
	interval                time.Duration
	log                     *slog.Logger
	onWrite                 func(what string)

	srcSum    [32]byte
	installed atomic.Bool
}

func newInstaller(cfg Config, log *slog.Logger, onWrite func(string)) (*installer, error) {
	src := cfg.PluginSource
	if src == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("find the agent's executable: %w", err)
		}
		src = exe
	}
	sum, err := fileSum(src)
	if err != nil {
		return nil, fmt.Errorf("plugin source: %w", err)
	}
	return &installer{
		binSrc: src, binDir: cfg.CNIBinDir, confDir: cfg.CNIConfDir, interval: cfg.InstallCheckInterval,
		log: log, onWrite: onWrite, srcSum: sum,
		entry: map[string]any{"type": plugin.Name, "agent_socket": cfg.PluginSocket, "timeout": cfg.PluginTimeout.String()},
	}, nil
}

func fileSum(path string) ([32]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return [32]byte{}, err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return [32]byte{}, err
	}
	return [32]byte(h.Sum(nil)), nil
}

// Installed reports whether the last check left both in place.
func (in *installer) Installed() bool { return in.installed.Load() }

// run checks now, then on every change in the two directories and every
// interval, until ctx ends.
func (in *installer) run(ctx context.Context) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch CNI directories: %w", err)
	}
	defer w.Close()
	for _, d := range []string{in.binDir, in.confDir} {
		if err := w.Add(d); err != nil {
			return fmt.Errorf("watch %s: %w", d, err)
		}
	}
	tick := time.NewTicker(in.interval)
	defer tick.Stop()
	// Changes come in bursts (our own writes too): settle before checking.
	settle := time.NewTimer(0)
	defer settle.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-w.Events:
			settle.Reset(100 * time.Millisecond)
		case err := <-w.Errors:
			in.log.Warn("CNI directory watch", "error", err)
		case <-tick.C:
			in.check()
		case <-settle.C:
			in.check()
		}
	}
}

func (in *installer) check() {
	err := in.ensure()
	in.installed.Store(err == nil)
	switch {
	case errors.Is(err, errNoConflist):
		in.log.Info("waiting for the node's network plugin", "dir", in.confDir)
	case err != nil:
		in.log.Error("install the CNI plugin", "error", err)
	}
}

// ensure installs the binary and the conflist entry where they differ from
// what they should be.
func (in *installer) ensure() error {
	if err := in.ensureBinary(); err != nil {
		return err
	}
	return in.ensureConflist()
}

func (in *installer) ensureBinary() error {
	dst := filepath.Join(in.binDir, plugin.Name)
	if sum, err := fileSum(dst); err == nil && sum == in.srcSum {
		return nil
	}
	src, err := os.Open(in.binSrc)
	if err != nil {
		return err
	}
	defer src.Close()
	if err := writeAtomic(dst, 0o755, func(w io.Writer) error {
		_, err := io.Copy(w, src)
		return err
	}); err != nil {
		return fmt.Errorf("install %s: %w", dst, err)
	}
	in.log.Info("installed the CNI plugin binary", "path", dst)
	in.onWrite("binary")
	return nil
}

// netConf returns the path of the network configuration the runtime uses:
// the first, by name, of the directory's *.conf, *.conflist and *.json.
func (in *installer) netConf() (string, error) {
	// libcni.ConfFiles lists the same, but importing libcni would bring its
	// tracing dependencies into the node agent for a directory listing.
	var files []string
	for _, ext := range confExtensions {
		m, err := filepath.Glob(filepath.Join(in.confDir, "*"+ext))
		if err != nil {
			return "", err
		}
		for _, f := range m {
			if st, err := os.Stat(f); err == nil && !st.IsDir() {
				files = append(files, f)
			}
		}
	}
	if len(files) == 0 {
		return "", errNoConflist
	}
	slices.Sort(files)
	return files[0], nil
}

func (in *installer) ensureConflist() error {
	path, err := in.netConf()
	if err != nil {
		return err
	}
	if filepath.Ext(path) != ".conflist" {
		return in.convert(path)
	}
	doc, plugins, err := readConflist(path)
	if err != nil {
		return err
	}
	want := append(withoutOurs(plugins), in.entry)
	if reflect.DeepEqual(normalize(plugins), normalize(want)) {
		return nil
	}
	doc["plugins"] = want
	if err := writeConflist(path, doc); err != nil {
		return err
	}
	in.log.Info("inserted the plugin into the conflist", "path", path)
	in.onWrite("conflist")
	return nil
}

// convert turns the single-plugin configuration at path (*.conf or *.json,
// which cannot chain a second plugin) into a conflist of the same name and
// network holding that plugin and ours, as the runtime itself would read
// it, and removes the original: the conflist, named like it, is then the
// runtime's first file.
func (in *installer) convert(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var single map[string]any
	if err := json.Unmarshal(b, &single); err != nil {
		return fmt.Errorf("%s is not a JSON object: %w", path, err)
	}
	if _, ok := single["plugins"]; ok {
		return fmt.Errorf("%s holds a plugin list: name it *.conflist", path)
	}
	if _, ok := single["type"].(string); !ok {
		return fmt.Errorf("%s names no plugin type", path)
	}
	doc := map[string]any{"cniVersion": single["cniVersion"], "name": single["name"],
		"plugins": append(withoutOurs([]any{single}), in.entry)}
	list := strings.TrimSuffix(path, filepath.Ext(path)) + ".conflist"
	if err := writeConflist(list, doc); err != nil {
		return err
	}
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("remove %s after converting it to %s: %w", path, list, err)
	}
	in.log.Info("converted the network configuration into a conflist and inserted the plugin", "from", path, "to", list)
	in.onWrite("conflist")
	return nil
}

// uninstall removes our entry from the conflist and the binary.
func (in *installer) uninstall() error {
	var errs []error
	if path, err := in.netConf(); err == nil && filepath.Ext(path) == ".conflist" {
		if doc, plugins, err := readConflist(path); err == nil {
			if rest := withoutOurs(plugins); len(rest) != len(plugins) {
				doc["plugins"] = rest
				errs = append(errs, writeConflist(path, doc))
			}
		} else {
			errs = append(errs, err)
		}
	}
	if err := os.Remove(filepath.Join(in.binDir, plugin.Name)); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func readConflist(path string) (map[string]any, []any, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	var doc map[string]any
	if err := json.Unmarshal(b, &doc); err != nil {
		return nil, nil, fmt.Errorf("%s is not a JSON object: %w", path, err)
	}
	plugins, ok := doc["plugins"].([]any)
	if !ok {
		return nil, nil, fmt.Errorf("%s has no plugins list", path)
	}
	return doc, plugins, nil
}

func writeConflist(path string, doc map[string]any) error {
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return err
	}
	mode := os.FileMode(0o644)
	if st, err := os.Stat(path); err == nil {
		mode = st.Mode().Perm()
	}
	return writeAtomic(path, mode, func(w io.Writer) error {
		_, err := io.Copy(w, bytes.NewReader(append(b, '\n')))
		return err
	})
}

func withoutOurs(plugins []any) []any {
	out := make([]any, 0, len(plugins))
	for _, p := range plugins {
		if m, ok := p.(map[string]any); ok && m["type"] == plugin.Name {
			continue
		}
		out = append(out, p)
	}
	return out
}

// normalize round-trips v through JSON so values built in Go compare equal
// to values decoded from a file.
func normalize(v any) any {
	b, err := json.Marshal(v)
	if err != nil {
		return v
	}
	var out any
	if err := json.Unmarshal(b, &out); err != nil {
		return v
	}
	return out
}

// writeAtomic writes a file through a temporary file in the same directory
// and a rename, so readers (the runtime) never see half a file.
func writeAtomic(path string, mode os.FileMode, write func(io.Writer) error) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if err := write(tmp); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
