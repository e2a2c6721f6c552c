//go:build !linux

package inpod

import "errors"

// CgroupID is Linux-only: elsewhere there is no cgroup to report.
func CgroupID(string, []string) (uint64, error) {
	return 0, errors.New("inpod: cgroups are Linux-only")
}
