package main

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/isthmus-mesh/isthmus/internal/kubeyaml"
	"github.com/isthmus-mesh/isthmus/internal/manifestdiff"
)

// Exit codes of manifest diff (diff's own convention).
const (
	exitDiffers   = 1
	exitDiffError = 2
)

// manifestDiffConfig holds the flags of manifest diff.
type manifestDiffConfig struct {
	Select, Ignore, Rename []string
}

func newManifestCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "manifest",
		Short: "Work with rendered manifests",
		Args:  cobra.NoArgs,
	}
	cmd.AddCommand(newManifestDiffCommand())
	return cmd
}

func newManifestDiffCommand() *cobra.Command {
	cfg := &manifestDiffConfig{}
	cmd := &cobra.Command{
		Use:   "diff A B",
		Short: "Compare two sets of rendered manifests (files or folders of multi-document YAML) object by object",
		Long: `Compares the objects of A and B by identity (Kind, Namespace, Name; the API group
but not its version) and prints, per changed object, each changed field as
path: old -> new, then the objects only in A or only in B.
Patterns are Kind:Namespace:Name with * as a wildcard (e.g. Service:*:isthmusd;
an empty namespace for cluster-scoped objects). Exits 0 when equal, 1 when they
differ, 2 on error.`,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) != 2 {
				return &exitError{code: exitDiffError, msg: fmt.Sprintf("manifest diff takes two paths, got %d", len(args))}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			differ, err := manifestDiff(*cfg, args[0], args[1], cmd.OutOrStdout())
			switch {
			case err != nil:
				return &exitError{code: exitDiffError, err: err}
			case differ:
				return &exitError{code: exitDiffers}
			}
			return nil
		},
	}
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &exitError{code: exitDiffError, err: err} })
	f := cmd.Flags()
	f.StringArrayVar(&cfg.Select, "select", nil, "compare only objects matching these Kind:Namespace:Name patterns (comma separated, repeatable)")
	f.StringArrayVar(&cfg.Ignore, "ignore", nil, "leave out objects matching these Kind:Namespace:Name patterns (comma separated, repeatable)")
	f.StringArrayVar(&cfg.Rename, "rename", nil, "Old->New pairs mapping objects of A to their names in B (comma separated, repeatable; a * in New keeps that part)")
	return cmd
}

// manifestDiff prints the differences of a and b and reports whether
// there are any.
func manifestDiff(cfg manifestDiffConfig, a, b string, out io.Writer) (bool, error) {
	var opts manifestdiff.Options
	for _, f := range []struct {
		flag string
		vals []string
		into *[]manifestdiff.Pattern
	}{{"--select", cfg.Select, &opts.Select}, {"--ignore", cfg.Ignore, &opts.Ignore}} {
		for _, v := range f.vals {
			pats, err := manifestdiff.ParsePatterns(v)
			if err != nil {
				return false, fmt.Errorf("%s: %w", f.flag, err)
			}
			*f.into = append(*f.into, pats...)
		}
	}
	for _, v := range cfg.Rename {
		rs, err := manifestdiff.ParseRenames(v)
		if err != nil {
			return false, fmt.Errorf("--rename: %w", err)
		}
		opts.Renames = append(opts.Renames, rs...)
	}
	left, err := kubeyaml.Load(a)
	if err != nil {
		return false, err
	}
	right, err := kubeyaml.Load(b)
	if err != nil {
		return false, err
	}
	res, err := manifestdiff.Compare(left, right, opts)
	if err != nil {
		return false, err
	}
	return !res.Equal(), res.Write(out)
}
