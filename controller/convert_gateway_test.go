package controller_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/controller"
)

// TestGatewayTLSPassthroughPort: a gateway Service's SNI passthrough port
// is its port named tls, or numbered 15443 unless that is its HBONE port
// (tls-hbone); a gateway without one has none.
func TestGatewayTLSPassthroughPort(t *testing.T) {
	svc := func(ports ...corev1.ServicePort) *corev1.Service {
		return &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "eastwest", Namespace: "istio-system",
			Labels: map[string]string{controller.NetworkLabel: "net2"}}, Spec: corev1.ServiceSpec{Ports: ports}}
	}
	for _, tc := range []struct {
		name       string
		ports      []corev1.ServicePort
		hbone, tls uint16
	}{
		{"istio's east-west gateway", []corev1.ServicePort{{Name: "status-port", Port: 15021}, {Name: "tls", Port: 15443}, {Name: "tls-hbone", Port: 15008}}, 15008, 15443},
		{"tls port renumbered", []corev1.ServicePort{{Name: "tls-hbone", Port: 15008}, {Name: "tls", Port: 8443}}, 15008, 8443},
		{"15443 unnamed", []corev1.ServicePort{{Port: 15008}, {Port: 15443}}, 15008, 15443},
		{"hbone only", []corev1.ServicePort{{Name: "tls-hbone", Port: 15008}}, 15008, 0},
		{"hbone on 15443", []corev1.ServicePort{{Name: "tls-hbone", Port: 15443}}, 15443, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gw := controller.GatewayCandidate("c2", svc(tc.ports...))
			require.NotNil(t, gw)
			require.Equal(t, tc.hbone, gw.HBONEPort)
			require.Equal(t, tc.tls, gw.TLSPassthroughPort)
		})
	}
}
