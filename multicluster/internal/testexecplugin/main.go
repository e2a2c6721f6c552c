// Command testexecplugin is an exec credential plugin for the multicluster
// tests; tests build it with `go build` and allowlist the binary. It never
// ships.
//
// Usage: testexecplugin MODE DIR. Every run appends MODE to DIR/runs,
// writes the names of its environment variables to DIR/env and the
// KUBERNETES_EXEC_INFO request to DIR/info. Modes:
//
//	serve  print an ExecCredential (apiVersion from the request) whose
//	       status is the content of DIR/status.json
//	raw    print DIR/out as it is
//	fail   print DIR/stderr to stderr and exit 3
//	sleep  start a child in the same process group, write both pids to
//	       DIR/pids and sleep for an hour
//	flood  print 1 MiB of 'x'
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: testexecplugin MODE DIR")
		os.Exit(2)
	}
	mode, dir := os.Args[1], os.Args[2]
	if err := run(mode, dir); err != nil {
		fmt.Fprintln(os.Stderr, "testexecplugin:", err)
		os.Exit(1)
	}
}

func run(mode, dir string) error {
	if mode == "child" {
		time.Sleep(time.Hour)
		return nil
	}
	if err := record(mode, dir); err != nil {
		return err
	}
	switch mode {
	case "serve":
		return serve(dir)
	case "raw":
		out, err := os.ReadFile(filepath.Join(dir, "out"))
		if err != nil {
			return err
		}
		_, err = os.Stdout.Write(out)
		return err
	case "fail":
		msg, _ := os.ReadFile(filepath.Join(dir, "stderr"))
		_, _ = os.Stderr.Write(msg)
		os.Exit(3)
	case "sleep":
		child := exec.Command(os.Args[0], "child", dir)
		if err := child.Start(); err != nil {
			return err
		}
		pids := fmt.Sprintf("%d\n%d\n", os.Getpid(), child.Process.Pid)
		if err := os.WriteFile(filepath.Join(dir, "pids"), []byte(pids), 0o600); err != nil {
			return err
		}
		time.Sleep(time.Hour)
	case "flood":
		_, err := os.Stdout.Write([]byte(strings.Repeat("x", 1<<20)))
		return err
	}
	return fmt.Errorf("unknown mode %q", mode)
}

// record notes the run, the environment's names and the request.
func record(mode, dir string) error {
	f, err := os.OpenFile(filepath.Join(dir, "runs"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(f, mode)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	var names []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		names = append(names, name)
	}
	slices.Sort(names)
	if err := os.WriteFile(filepath.Join(dir, "env"), []byte(strings.Join(names, "\n")), 0o600); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "info"), []byte(os.Getenv("KUBERNETES_EXEC_INFO")), 0o600)
}

// serve prints an ExecCredential answering the request in the environment.
func serve(dir string) error {
	var req struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := json.Unmarshal([]byte(os.Getenv("KUBERNETES_EXEC_INFO")), &req); err != nil || req.Kind != "ExecCredential" {
		return fmt.Errorf("no valid KUBERNETES_EXEC_INFO (%v)", err)
	}
	status, err := os.ReadFile(filepath.Join(dir, "status.json"))
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]any{
		"apiVersion": req.APIVersion,
		"kind":       "ExecCredential",
		"status":     json.RawMessage(status),
	})
}
