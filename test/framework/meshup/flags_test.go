package meshup_test

import (
	"flag"
	"io"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/test/framework/meshup"
)

func parse(t *testing.T, args ...string) *meshup.Flags {
	t.Helper()
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	f := meshup.AddFlags(fs)
	require.NoError(t, fs.Parse(args))
	return f
}

func TestFlagsLocalByDefault(t *testing.T) {
	f := parse(t)
	require.False(t, f.External())
	opts, err := f.Options()
	require.NoError(t, err)
	require.Empty(t, opts.Clusters)
}

func TestFlagsExternal(t *testing.T) {
	f := parse(t,
		"-isthmus.kubeconfig", "cluster-1=/k/one", "-isthmus.kubeconfig", "cluster-2=/k/two",
		"-isthmus.network", "cluster-1=network1", "-isthmus.network", "cluster-2=network2",
		"-isthmus.context", "cluster-2=kind-two",
		"-isthmus.remote-server", "cluster-2=https://10.2.0.1:6443",
		"-isthmus.node-ip", "cluster-1=10.1.0.2",
		"-isthmus.values", "cluster-1/isthmus-cni=netnsDir=/run/x", "-isthmus.values", "cluster-1/isthmus-cni=podCgroupRoots={/a}",
		"-isthmus.image", "server=reg/isthmus/server:1",
		"-isthmus.registry", "reg:5000",
	)
	require.True(t, f.External())
	opts, err := f.Options()
	require.NoError(t, err)
	require.Equal(t, "reg:5000", opts.Registry)
	require.Equal(t, map[string]string{"server": "reg/isthmus/server:1"}, opts.Images)
	require.Len(t, opts.Clusters, 2)
	c1, c2 := opts.Clusters[0], opts.Clusters[1]
	require.Equal(t, meshup.ExternalCluster{
		Name: "cluster-1", Network: "network1", Kubeconfig: "/k/one", NodeIP: netip.MustParseAddr("10.1.0.2"),
		Values: map[string][]string{"isthmus-cni": {"netnsDir=/run/x", "podCgroupRoots={/a}"}},
	}, c1)
	require.Equal(t, "kind-two", c2.Context)
	require.Equal(t, "https://10.2.0.1:6443", c2.RemoteServer)
}

func TestFlagsErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-isthmus.kubeconfig", "c1=/k", "-isthmus.registry", "r"}, "cluster c1: no -isthmus.network"},
		{[]string{"-isthmus.kubeconfig", "c1=/k", "-isthmus.network", "c1=n"}, "needs -isthmus.registry"},
		{[]string{"-isthmus.kubeconfig", "c1=/k", "-isthmus.network", "c1=n", "-isthmus.network", "c9=n", "-isthmus.registry", "r"}, `-isthmus.network: no -isthmus.kubeconfig for cluster "c9"`},
		{[]string{"-isthmus.kubeconfig", "c1=/k", "-isthmus.kubeconfig", "c1=/j", "-isthmus.network", "c1=n", "-isthmus.registry", "r"}, "cluster c1 twice"},
		{[]string{"-isthmus.kubeconfig", "c1=/k", "-isthmus.network", "c1=n", "-isthmus.registry", "r", "-isthmus.node-ip", "c1=nope"}, "-isthmus.node-ip c1"},
		{[]string{"-isthmus.kubeconfig", "c1=/k", "-isthmus.network", "c1=n", "-isthmus.registry", "r", "-isthmus.values", "c1=x=y"}, "want cluster/release=key=value"},
	} {
		_, err := parse(t, c.args...).Options()
		require.ErrorContains(t, err, c.want, "%v", c.args)
	}
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	meshup.AddFlags(fs)
	require.ErrorContains(t, fs.Parse([]string{"-isthmus.kubeconfig", "nopath"}), "want key=value")
}
