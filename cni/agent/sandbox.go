//go:build linux

package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/isthmus-mesh/isthmus/ztunnel/netns"
)

// sandboxRecord is what the runtime told the agent in a CNI ADD: which pod
// the sandbox is, and which network namespace (by path and by identity).
type sandboxRecord struct {
	ContainerID  string    `json:"containerID"`
	PodNamespace string    `json:"podNamespace"`
	PodName      string    `json:"podName"`
	PodUID       string    `json:"podUID"`
	Netns        string    `json:"netns"`
	Dev          uint64    `json:"dev"`
	Ino          uint64    `json:"ino"`
	Recorded     time.Time `json:"recorded"`
}

func (r *sandboxRecord) id() netns.ID { return netns.ID{Dev: r.Dev, Ino: r.Ino} }

// containerIDPattern is what a sandbox ID must look like to name a file
// (runtimes use 64 hex digits).
var containerIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,254}$`)

// errRecordMismatch: a record's path no longer names the namespace the
// runtime reported.
var errRecordMismatch = errors.New("the recorded path names another network namespace than the one recorded")

// sandboxStore keeps the records in memory and, one file per sandbox, in
// a directory (written atomically). Safe for concurrent use.
type sandboxStore struct {
	dir     string
	procDir string
	log     *slog.Logger

	mu   sync.Mutex
	recs map[string]*sandboxRecord // by container ID
}

// openSandboxStore creates dir (0700) and loads its records; records whose
// namespace is gone are removed.
func openSandboxStore(dir, procDir string, log *slog.Logger) (*sandboxStore, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("agent: state directory: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("agent: state directory: %w", err)
	}
	s := &sandboxStore{dir: dir, procDir: procDir, log: log, recs: map[string]*sandboxRecord{}}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("agent: state directory: %w", err)
	}
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || strings.HasPrefix(name, ".") || !strings.HasSuffix(name, ".json") {
			continue
		}
		rec, err := readRecord(filepath.Join(dir, name))
		if err != nil {
			log.Warn("unreadable sandbox record left alone", "file", name, "error", err)
			continue
		}
		if rec.ContainerID+".json" != name {
			log.Warn("sandbox record under another sandbox's name left alone", "file", name)
			continue
		}
		f, err := s.reopen(rec)
		if errors.Is(err, os.ErrNotExist) {
			s.removeFile(rec.ContainerID)
			continue
		}
		if f != nil {
			f.Close()
		}
		s.recs[rec.ContainerID] = rec
	}
	return s, nil
}

func readRecord(path string) (*sandboxRecord, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	rec := &sandboxRecord{}
	if err := json.Unmarshal(b, rec); err != nil {
		return nil, err
	}
	if !containerIDPattern.MatchString(rec.ContainerID) || rec.PodUID == "" || !filepath.IsAbs(rec.Netns) {
		return nil, errors.New("incomplete record")
	}
	return rec, nil
}

// put records a sandbox (replacing an older record of the same ID).
func (s *sandboxStore) put(rec *sandboxRecord) error {
	if !containerIDPattern.MatchString(rec.ContainerID) {
		return fmt.Errorf("sandbox ID %q cannot name a record", rec.ContainerID)
	}
	if rec.PodUID == "" {
		return errors.New("the runtime named no pod UID")
	}
	if !filepath.IsAbs(rec.Netns) {
		return fmt.Errorf("netns path %q is not absolute", rec.Netns)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	path := filepath.Join(s.dir, rec.ContainerID+".json")
	if err := writeAtomic(path, 0o600, func(w io.Writer) error { return json.NewEncoder(w).Encode(rec) }); err != nil {
		return fmt.Errorf("write sandbox record: %w", err)
	}
	syncDir(s.dir)
	s.recs[rec.ContainerID] = rec
	return nil
}

// remove forgets the sandbox containerID (a CNI DEL).
func (s *sandboxStore) remove(containerID string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.recs[containerID]; ok {
		delete(s.recs, containerID)
		s.removeFile(containerID)
	}
}

func (s *sandboxStore) removeFile(containerID string) {
	if err := os.Remove(filepath.Join(s.dir, containerID+".json")); err != nil && !errors.Is(err, os.ErrNotExist) {
		s.log.Warn("remove sandbox record", "sandbox", containerID, "error", err)
	}
	syncDir(s.dir)
}

// byUID returns the records of pod uid, newest first.
func (s *sandboxStore) byUID(uid string) []*sandboxRecord {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*sandboxRecord
	for _, r := range s.recs {
		if r.PodUID == uid {
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b *sandboxRecord) int { return b.Recorded.Compare(a.Recorded) })
	return out
}

// reopen opens the namespace the record names and checks it is the one
// recorded: os.ErrNotExist when it is gone, errRecordMismatch when the
// path now names another namespace.
func (s *sandboxStore) reopen(rec *sandboxRecord) (*os.File, error) {
	p := rec.Netns
	if rest, ok := strings.CutPrefix(p, "/proc/"); ok && s.procDir != "" && s.procDir != Disabled {
		// A runtime that names the namespace by a process: the node's
		// /proc is mounted at ProcDir here.
		p = filepath.Join(s.procDir, rest)
	}
	f, err := netns.Open(p)
	if err != nil {
		return nil, err
	}
	id, err := netns.IDOf(f)
	if err != nil {
		f.Close()
		return nil, err
	}
	if id != rec.id() {
		f.Close()
		return nil, errRecordMismatch
	}
	return f, nil
}

func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
}
