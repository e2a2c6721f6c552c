// Package readme extracts the shell commands of a Markdown section, so that
// tests can run every command a README tells users to run.
package readme

import (
	"fmt"
	"os"
	"strings"
)

// Commands returns the commands in the fenced code blocks of the section
// whose heading is heading (e.g. "## Installing on real clusters") in the
// Markdown file at path, up to the next heading of the same level:
// continuation lines ending in a backslash joined, comments and blank lines
// dropped.
func Commands(path, heading string) ([]string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	level, _, _ := strings.Cut(heading, " ")
	_, section, ok := strings.Cut(string(raw), "\n"+heading+"\n")
	if !ok {
		return nil, fmt.Errorf("%s: no section %q", path, heading)
	}
	section, _, _ = strings.Cut(section, "\n"+level+" ")
	var cmds []string
	inCode, cur := false, ""
	for _, line := range strings.Split(section, "\n") {
		if strings.HasPrefix(line, "```") {
			inCode = !inCode
			continue
		}
		line = strings.TrimSpace(line)
		if !inCode || line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if c, _, found := strings.Cut(line, " #"); found {
			line = strings.TrimSpace(c)
		}
		if strings.HasSuffix(line, `\`) {
			cur += strings.TrimSpace(strings.TrimSuffix(line, `\`)) + " "
			continue
		}
		cmds = append(cmds, cur+line)
		cur = ""
	}
	if len(cmds) == 0 {
		return nil, fmt.Errorf("%s: section %q has no command", path, heading)
	}
	return cmds, nil
}
