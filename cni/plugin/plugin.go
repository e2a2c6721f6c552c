// Package plugin is the chained CNI plugin "isthmus-cni": the container
// runtime runs it after the node's network plugin for every pod sandbox, and
// it reports the event to the node agent over the agent's unix socket and
// passes the previous result through unchanged. It decides nothing itself:
// the agent answers whether the pod is enrolled, and an ADD fails (so the
// runtime retries the sandbox) when the agent is unreachable or could not
// enrol a pod that should be. A DEL never fails for want of the agent: the
// pod's rules go with its namespace, and the agent also sees the pod
// deleted through the API.
//
// Plugin and agent speak one JSON request and one JSON reply per
// connection on a SOCK_SEQPACKET socket; an ADD or CHECK carries the pod's
// network namespace as an SCM_RIGHTS descriptor, so the agent never needs to
// resolve the runtime's netns path in its own mount namespace.
package plugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/isthmus-mesh/isthmus/cni/zds"
)

// Name is the plugin's type in the conflist and its binary's name.
const Name = "isthmus-cni"

// DefaultTimeout bounds the plugin's exchange with the agent.
const DefaultTimeout = 10 * time.Second

// Conf is the plugin's entry in the conflist.
type Conf struct {
	types.PluginConf
	// AgentSocket is the agent's plugin socket (a path on the node).
	AgentSocket string `json:"agent_socket"`
	// Timeout bounds the exchange with the agent, as a Go duration
	// ("10s"); default DefaultTimeout.
	Timeout string `json:"timeout,omitempty"`
}

// Commands reported to the agent.
const (
	CommandAdd   = "ADD"
	CommandDel   = "DEL"
	CommandCheck = "CHECK"
)

// Event is what the plugin tells the agent.
type Event struct {
	Command      string       `json:"command"`
	ContainerID  string       `json:"containerID"`
	Netns        string       `json:"netns,omitempty"`
	IfName       string       `json:"ifName,omitempty"`
	PodName      string       `json:"podName,omitempty"`
	PodNamespace string       `json:"podNamespace,omitempty"`
	PodUID       string       `json:"podUID,omitempty"`
	IPs          []netip.Addr `json:"ips,omitempty"`
}

// Reply is the agent's answer. Error empty means success; Enrolled tells
// whether the pod is in the mesh (for the runtime's logs, nothing more).
type Reply struct {
	Error    string `json:"error,omitempty"`
	Enrolled bool   `json:"enrolled,omitempty"`
}

// k8sArgs are the CNI_ARGS kubelet's runtimes pass.
type k8sArgs struct {
	types.CommonArgs
	K8S_POD_NAME               types.UnmarshallableString
	K8S_POD_NAMESPACE          types.UnmarshallableString
	K8S_POD_UID                types.UnmarshallableString
	K8S_POD_INFRA_CONTAINER_ID types.UnmarshallableString
}

// Main runs the plugin for the runtime (reads CNI_* variables and stdin,
// writes the result to stdout, exits).
func Main() {
	skel.PluginMainFuncs(skel.CNIFuncs{Add: cmdAdd, Del: cmdDel, Check: cmdCheck},
		version.All, "isthmus-cni: enrols pods into the Isthmus mesh (chained plugin)")
}

// parseConf decodes the plugin's configuration and its prevResult.
func parseConf(stdin []byte) (*Conf, time.Duration, error) {
	conf := &Conf{}
	if err := json.Unmarshal(stdin, conf); err != nil {
		return nil, 0, types.NewError(types.ErrDecodingFailure, "isthmus-cni: cannot decode the network configuration", err.Error())
	}
	if conf.AgentSocket == "" {
		return nil, 0, types.NewError(types.ErrInvalidNetworkConfig, "isthmus-cni: agent_socket is not set", "")
	}
	timeout := DefaultTimeout
	if conf.Timeout != "" {
		d, err := time.ParseDuration(conf.Timeout)
		if err != nil || d <= 0 {
			return nil, 0, types.NewError(types.ErrInvalidNetworkConfig, "isthmus-cni: bad timeout", conf.Timeout)
		}
		timeout = d
	}
	if err := version.ParsePrevResult(&conf.PluginConf); err != nil {
		return nil, 0, types.NewError(types.ErrDecodingFailure, "isthmus-cni: cannot decode prevResult", err.Error())
	}
	return conf, timeout, nil
}

// event builds the agent's event from the runtime's arguments.
func event(command string, args *skel.CmdArgs, conf *Conf) (*Event, error) {
	var ka k8sArgs
	ka.IgnoreUnknown = true
	if err := types.LoadArgs(args.Args, &ka); err != nil {
		return nil, types.NewError(types.ErrInvalidEnvironmentVariables, "isthmus-cni: cannot parse CNI_ARGS", err.Error())
	}
	ev := &Event{Command: command, ContainerID: args.ContainerID, Netns: args.Netns, IfName: args.IfName,
		PodName: string(ka.K8S_POD_NAME), PodNamespace: string(ka.K8S_POD_NAMESPACE), PodUID: string(ka.K8S_POD_UID)}
	if conf.PrevResult != nil {
		res, err := current.NewResultFromResult(conf.PrevResult)
		if err != nil {
			return nil, types.NewError(types.ErrDecodingFailure, "isthmus-cni: cannot convert prevResult", err.Error())
		}
		for _, ip := range res.IPs {
			if a, ok := netip.AddrFromSlice(ip.Address.IP); ok {
				ev.IPs = append(ev.IPs, a.Unmap())
			}
		}
	}
	return ev, nil
}

func cmdAdd(args *skel.CmdArgs) error {
	conf, timeout, err := parseConf(args.StdinData)
	if err != nil {
		return err
	}
	if conf.PrevResult == nil {
		return types.NewError(types.ErrInvalidNetworkConfig,
			"isthmus-cni must be chained after the network plugin (no prevResult)", "")
	}
	if err := report(CommandAdd, args, conf, timeout, true); err != nil {
		return err
	}
	return types.PrintResult(conf.PrevResult, conf.CNIVersion)
}

func cmdCheck(args *skel.CmdArgs) error {
	conf, timeout, err := parseConf(args.StdinData)
	if err != nil {
		return err
	}
	return report(CommandCheck, args, conf, timeout, true)
}

func cmdDel(args *skel.CmdArgs) error {
	conf, timeout, err := parseConf(args.StdinData)
	if err != nil {
		// A DEL must not be blocked by a configuration we cannot read.
		return nil
	}
	if err := report(CommandDel, args, conf, timeout, false); err != nil {
		var terr *types.Error
		if errors.As(err, &terr) && terr.Code == types.ErrTryAgainLater {
			return nil // the agent is away: it will see the pod's deletion
		}
		return err
	}
	return nil
}

// report sends the event (with the pod's namespace when withNetns) and
// waits for the agent's reply.
func report(command string, args *skel.CmdArgs, conf *Conf, timeout time.Duration, withNetns bool) error {
	ev, err := event(command, args, conf)
	if err != nil {
		return err
	}
	var ns *os.File
	if withNetns && args.Netns != "" {
		f, err := os.Open(args.Netns)
		if err != nil {
			return types.NewError(types.ErrInvalidNetNS, "isthmus-cni: cannot open the pod's network namespace", err.Error())
		}
		defer f.Close()
		ns = f
	}
	reply, err := Call(context.Background(), conf.AgentSocket, timeout, ev, ns)
	if err != nil {
		return types.NewError(types.ErrTryAgainLater, "isthmus-cni: the Isthmus node agent is unreachable", err.Error())
	}
	if reply.Error != "" {
		return types.NewError(types.ErrInternal,
			fmt.Sprintf("isthmus-cni: the Isthmus node agent refused %s of pod %s/%s", command, ev.PodNamespace, ev.PodName),
			reply.Error)
	}
	return nil
}

// Call sends ev (and ns, if not nil) to the agent at socket and returns its
// reply, all within timeout.
func Call(ctx context.Context, socket string, timeout time.Duration, ev *Event, ns *os.File) (*Reply, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "unixpacket", socket)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	uc := c.(*net.UnixConn)
	if dl, ok := ctx.Deadline(); ok {
		_ = uc.SetDeadline(dl)
	}
	if err := zds.Write(uc, ev, ns); err != nil {
		return nil, err
	}
	var reply Reply
	fd, err := zds.Read(uc, &reply)
	if fd != nil {
		fd.Close()
	}
	if err != nil {
		return nil, fmt.Errorf("read the agent's reply: %w", err)
	}
	return &reply, nil
}
