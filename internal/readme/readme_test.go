package readme

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCommands(t *testing.T) {
	md := "# T\n\n## Install\n\ntext `not a command`\n\n```sh\n# comment\nmake images   # inline comment\nhelm install a \\\n  b -n c\n\n```\n\n### Sub\n\n```\nx y\n```\n\n## Next\n\n```\nnot this\n```\n"
	path := filepath.Join(t.TempDir(), "README.md")
	require.NoError(t, os.WriteFile(path, []byte(md), 0o644))
	cmds, err := Commands(path, "## Install")
	require.NoError(t, err)
	require.Equal(t, []string{"make images", "helm install a b -n c", "x y"}, cmds)

	_, err = Commands(path, "## Missing")
	require.ErrorContains(t, err, `no section "## Missing"`)
	_, err = Commands(filepath.Join(t.TempDir(), "none.md"), "## Install")
	require.Error(t, err)
}
