package manifestdiff

import (
	"bufio"
	"fmt"
	"io"
	"strings"
)

// Write prints the result for people: each changed object (~) with its
// changed fields as `path: old -> new` (multi-line strings as a line
// diff), then added (+) and removed (-) objects, then a summary line.
func (r *Result) Write(w io.Writer) error {
	bw := bufio.NewWriter(w)
	for _, d := range r.Changed {
		head := "~ " + d.ID.String()
		if d.From != d.ID {
			head += " (renamed from " + d.From.String() + ")"
		}
		fmt.Fprintln(bw, head)
		for _, c := range d.Changes {
			writeChange(bw, c)
		}
	}
	for _, id := range r.Added {
		fmt.Fprintln(bw, "+ "+id.String()+" (only in the second set)")
	}
	for _, id := range r.Removed {
		fmt.Fprintln(bw, "- "+id.String()+" (only in the first set)")
	}
	if r.Equal() {
		fmt.Fprintf(bw, "No differences (%d objects compared).\n", r.Compared)
	} else {
		fmt.Fprintf(bw, "%d changed, %d added, %d removed (%d objects in both sets).\n", len(r.Changed), len(r.Added), len(r.Removed), r.Compared)
	}
	return bw.Flush()
}

func writeChange(w io.Writer, c Change) {
	old, oldOK := c.Old.(string)
	nw, newOK := c.New.(string)
	if oldOK && newOK && (strings.Contains(old, "\n") || strings.Contains(nw, "\n")) {
		fmt.Fprintf(w, "    %s:\n", c.Path)
		for _, l := range lineDiff(strings.Split(old, "\n"), strings.Split(nw, "\n")) {
			fmt.Fprintln(w, "      "+l)
		}
		return
	}
	side := func(v any, missing bool) string {
		if missing {
			return "(absent)"
		}
		return formatValue(v)
	}
	fmt.Fprintf(w, "    %s: %s -> %s\n", c.Path, side(c.Old, c.OldMissing), side(c.New, c.NewMissing))
}

// maxLineDiffCells bounds the longest-common-subsequence table; larger
// texts are shown as all old lines removed and all new lines added.
const maxLineDiffCells = 4 << 20

// lineDiff returns the removed ("- ") and added ("+ ") lines turning a
// into b, in order, along a longest common subsequence.
func lineDiff(a, b []string) []string {
	if (len(a)+1)*(len(b)+1) > maxLineDiffCells {
		var out []string
		for _, l := range a {
			out = append(out, "- "+l)
		}
		for _, l := range b {
			out = append(out, "+ "+l)
		}
		return out
	}
	// lcs[i][j] is the LCS length of a[i:] and b[j:].
	lcs := make([][]int, len(a)+1)
	for i := range lcs {
		lcs[i] = make([]int, len(b)+1)
	}
	for i := len(a) - 1; i >= 0; i-- {
		for j := len(b) - 1; j >= 0; j-- {
			if a[i] == b[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	var out []string
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case i < len(a) && j < len(b) && a[i] == b[j]:
			i, j = i+1, j+1
		case i < len(a) && (j == len(b) || lcs[i+1][j] >= lcs[i][j+1]):
			out = append(out, "- "+a[i])
			i++
		default:
			out = append(out, "+ "+b[j])
			j++
		}
	}
	return out
}
