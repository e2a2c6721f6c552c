// Package msg is the message catalogue of `isthmusctl analyze`: every
// message type with its stable code, level, template and named arguments,
// generated from messages.yaml, and the Message value analyzers report.
package msg

//go:generate go run ./gen

import (
	"encoding/json"
	"fmt"
	"strings"
)

// Level is how serious a message is. Levels are ordered: Info < Warning < Error.
type Level int

// The levels.
const (
	Info Level = iota + 1
	Warning
	Error
)

// String returns the level's name as the catalogue spells it.
func (l Level) String() string {
	switch l {
	case Info:
		return "Info"
	case Warning:
		return "Warning"
	case Error:
		return "Error"
	}
	return fmt.Sprintf("Level(%d)", int(l))
}

// ParseLevel parses a level name, case-insensitively.
func ParseLevel(s string) (Level, error) {
	for _, l := range []Level{Info, Warning, Error} {
		if strings.EqualFold(s, l.String()) {
			return l, nil
		}
	}
	return 0, fmt.Errorf("unknown level %q: want Info, Warning or Error", s)
}

// MarshalText encodes the level's name.
func (l Level) MarshalText() ([]byte, error) { return []byte(l.String()), nil }

// Type is one entry of the catalogue. Its values are the generated
// package-level variables; they are never changed.
type Type struct {
	// Code is stable: ISM0001...
	Code string
	// Name is the type's name in the catalogue.
	Name  string
	Level Level
	// Template is a fmt format with one verb per argument.
	Template string
	// Args names the template's arguments, in order.
	Args []string
	// Description explains the message for docs/analyzers.md.
	Description string
}

// Resource is what a message is about: a Kubernetes object (Kind,
// Namespace, Name) in a cluster, or a mesh-level thing such as a Network
// (Kind "Network", no namespace).
type Resource struct {
	Cluster   string `json:"cluster,omitempty"`
	Kind      string `json:"kind"`
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name"`
}

// String is Kind/Namespace/Name, or Kind/Name without a namespace: the
// form --suppress matches.
func (r Resource) String() string {
	if r.Namespace == "" {
		return r.Kind + "/" + r.Name
	}
	return r.Kind + "/" + r.Namespace + "/" + r.Name
}

// Message is one finding: a catalogue type, the resource it is about and
// the template's arguments. Values are immutable once made.
type Message struct {
	Type     *Type
	Resource Resource
	// Args are the template's arguments, in the order of Type.Args.
	Args []any
}

// Text renders the template with the arguments.
func (m Message) Text() string { return fmt.Sprintf(m.Type.Template, m.Args...) }

// String is the one-line form: "Error [ISM0001] (Secret/ns/name cluster-2) text".
func (m Message) String() string {
	where := m.Resource.String()
	if m.Resource.Cluster != "" {
		where += " in " + m.Resource.Cluster
	}
	return fmt.Sprintf("%s [%s] (%s) %s", m.Type.Level, m.Type.Code, where, m.Text())
}

// jsonMessage is the JSON and YAML form of a Message.
type jsonMessage struct {
	Code     string         `json:"code"`
	Level    Level          `json:"level"`
	Type     string         `json:"type"`
	Resource Resource       `json:"resource"`
	Message  string         `json:"message"`
	Args     map[string]any `json:"args,omitempty"`
}

// MarshalJSON encodes the code, level, type name, resource, rendered text
// and the arguments by name.
func (m Message) MarshalJSON() ([]byte, error) {
	args := make(map[string]any, len(m.Args))
	for i, a := range m.Args {
		if i < len(m.Type.Args) {
			args[m.Type.Args[i]] = a
		}
	}
	return json.Marshal(jsonMessage{Code: m.Type.Code, Level: m.Type.Level, Type: m.Type.Name, Resource: m.Resource, Message: m.Text(), Args: args})
}

// ByCode returns the catalogue type with that code.
func ByCode(code string) (*Type, bool) {
	for _, t := range All() {
		if t.Code == code {
			return t, true
		}
	}
	return nil, false
}
