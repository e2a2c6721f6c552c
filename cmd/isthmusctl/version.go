package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/isthmus-mesh/isthmus/internal/version"
)

// versionConfig holds the flags of `isthmusctl version`.
type versionConfig struct {
	// ClientOnly skips asking pilot.
	ClientOnly bool
	// Output is table (two lines), json or yaml.
	Output string
}

// versions is what `isthmusctl version -o json|yaml` prints.
type versions struct {
	Client version.Info  `json:"client"`
	Server *version.Info `json:"server,omitempty"`
}

func newVersionCommand(pilot func() *pilotClient) *cobra.Command {
	vc := &versionConfig{}
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print isthmusctl's version and the version of the pilot it talks to (--pilot)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(vc.Output); err != nil {
				return err
			}
			v := versions{Client: version.Get()}
			var serverErr error
			if !vc.ClientOnly {
				var s version.Info
				if serverErr = pilot().get(cmd.Context(), "/version", &s); serverErr == nil {
					v.Server = &s
				}
			}
			if err := printVersions(cmd, vc.Output, v); err != nil {
				return err
			}
			if serverErr != nil {
				return fmt.Errorf("server version: %w", serverErr)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&vc.ClientOnly, "client", false, "print only isthmusctl's version; do not contact pilot")
	cmd.Flags().StringVarP(&vc.Output, "output", "o", outputTable, "output format: table, json or yaml")
	return cmd
}

// printVersions writes v; the table form is one line per side, the client
// first (printed even when pilot cannot be reached).
func printVersions(cmd *cobra.Command, format string, v versions) error {
	w := cmd.OutOrStdout()
	if format != outputTable {
		return printObject(w, format, v)
	}
	if _, err := fmt.Fprintf(w, "client: %s\n", v.Client); err != nil {
		return err
	}
	if v.Server != nil {
		_, err := fmt.Fprintf(w, "server: %s\n", *v.Server)
		return err
	}
	return nil
}
