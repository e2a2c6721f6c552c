package realnode

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/isthmus-mesh/isthmus/test/framework"
)

// dirPrefix names every environment's folder in os.TempDir() and its
// cgroups: isthmus-rn-<pid>-<random>.
const dirPrefix = "isthmus-rn-"

// lockDir takes an exclusive flock on dir's lock file, held while the
// returned file is open (the kernel drops it when the owner dies).
func lockDir(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// sweepOrphans cleans up after environments whose test process was killed
// outright (its owner's pid is gone and its lock free; its kubelet, containerd and namespace holder died with it, by
// Pdeathsig; the shims and containers did not): for every folder whose
// lock is free, it kills the processes naming the folder and those in its
// cgroups, removes the cgroups, then the folder.
func sweepOrphans() {
	entries, err := os.ReadDir(os.TempDir())
	if err != nil {
		return
	}
	for _, e := range entries {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), dirPrefix) {
			continue
		}
		// The owner's pid must be gone too: a folder just made is not yet
		// locked.
		owner, _, _ := strings.Cut(strings.TrimPrefix(e.Name(), dirPrefix), "-")
		if pid, err := strconv.Atoi(owner); err != nil || syscall.Kill(pid, 0) == nil {
			continue
		}
		dir := filepath.Join(os.TempDir(), e.Name())
		lock, err := lockDir(dir)
		if err != nil {
			continue // alive, or not ours to judge
		}
		killAll(framework.PIDsWithArg(dir))
		if removeCgroups(e.Name()) == nil {
			_ = os.RemoveAll(dir)
		}
		lock.Close()
	}
}
