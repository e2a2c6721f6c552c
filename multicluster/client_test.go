package multicluster_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/isthmus-mesh/isthmus/multicluster"
)

// TestClientSharesOneConnection: the typed and the dynamic clients of one
// Client share one transport, so a cluster costs one connection to its API
// server, and Close drops it.
func TestClientSharesOneConnection(t *testing.T) {
	cl, err := multicluster.DefaultClientBuilder(kubeconfig(t, "remote-1", "remote-1"), "remote-1")
	require.NoError(t, err)
	ctx := context.Background()
	_, err = cl.Kube.CoreV1().Namespaces().List(ctx, metav1.ListOptions{Limit: 1})
	require.NoError(t, err)
	_, err = cl.Dynamic.Resource(schema.GroupVersionResource{Version: "v1", Resource: "namespaces"}).List(ctx, metav1.ListOptions{Limit: 1})
	require.NoError(t, err)
	require.Equal(t, 1, cl.OpenConnections(), "typed and dynamic clients on one connection")
	cl.Close()
	require.Equal(t, 0, cl.OpenConnections())
}
