package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"k8s.io/apimachinery/pkg/util/duration"
	"sigs.k8s.io/yaml"
)

// Output formats of the -o flag.
const (
	outputTable = "table"
	outputJSON  = "json"
	outputYAML  = "yaml"
)

func checkOutput(format string) error {
	switch format {
	case outputTable, outputJSON, outputYAML:
		return nil
	}
	return fmt.Errorf("unknown output format %q: want table, json or yaml", format)
}

// printObject writes v as indented JSON or as YAML.
func printObject(w io.Writer, format string, v any) error {
	switch format {
	case outputJSON:
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	case outputYAML:
		b, err := yaml.Marshal(v)
		if err != nil {
			return fmt.Errorf("encode YAML: %w", err)
		}
		_, err = w.Write(b)
		return err
	}
	return fmt.Errorf("output format %q is not a document format", format)
}

// table writes aligned columns, kubectl style.
type table struct {
	tw *tabwriter.Writer
}

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 8, 3, ' ', 0)}
	t.row(header...)
	return t
}

func (t *table) row(cells ...string) {
	for i, c := range cells {
		if c == "" {
			cells[i] = "-"
		}
	}
	fmt.Fprintln(t.tw, strings.Join(cells, "\t"))
}

func (t *table) flush() error { return t.tw.Flush() }

// age renders how long ago ts was ("" for the zero time).
func age(now, ts time.Time) string {
	if ts.IsZero() {
		return ""
	}
	return duration.HumanDuration(now.Sub(ts)) + " ago"
}
