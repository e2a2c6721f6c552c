package selection_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/isthmus-mesh/isthmus/cni/selection"
)

func TestDecide(t *testing.T) {
	ambient := map[string]string{selection.LabelDataplaneMode: selection.ModeAmbient}
	isthmusAmbient := map[string]string{selection.LabelIsthmusDataplaneMode: selection.ModeAmbient}
	ns := func(name string, labels map[string]string) *corev1.Namespace {
		return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
	}
	type podOpt func(*corev1.Pod)
	pod := func(namespace string, opts ...podOpt) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: namespace}}
		for _, o := range opts {
			o(p)
		}
		return p
	}
	label := func(k, v string) podOpt {
		return func(p *corev1.Pod) {
			if p.Labels == nil {
				p.Labels = map[string]string{}
			}
			p.Labels[k] = v
		}
	}
	hostNetwork := func(p *corev1.Pod) { p.Spec.HostNetwork = true }
	sidecar := func(p *corev1.Pod) {
		p.Annotations = map[string]string{selection.AnnotationSidecarStatus: `{"containers":["istio-proxy"]}`}
	}

	cases := []struct {
		name   string
		cfg    selection.Config
		pod    *corev1.Pod
		ns     *corev1.Namespace
		want   bool
		reason selection.Reason
	}{
		{"ambient namespace", selection.Config{}, pod("app"), ns("app", ambient), true, selection.Enrolled},
		{"isthmus label on the namespace", selection.Config{}, pod("app"), ns("app", isthmusAmbient), true, selection.Enrolled},
		{"unlabelled namespace", selection.Config{}, pod("app"), ns("app", nil), false, selection.NamespaceNotAmbient},
		{"namespace with another mode", selection.Config{}, pod("app"),
			ns("app", map[string]string{selection.LabelDataplaneMode: "sidecar"}), false, selection.NamespaceNotAmbient},
		{"pod opts out", selection.Config{}, pod("app", label(selection.LabelDataplaneMode, selection.ModeNone)),
			ns("app", ambient), false, selection.PodOptOut},
		// Pod labels override the namespace's in both directions (Istio's
		// precedence; docs/architecture.md and the CNI chart's README).
		{"pod label ambient in an unlabelled namespace", selection.Config{}, pod("app", label(selection.LabelDataplaneMode, selection.ModeAmbient)),
			ns("app", nil), true, selection.PodEnrolled},
		{"isthmus pod label ambient in an unlabelled namespace", selection.Config{}, pod("app", label(selection.LabelIsthmusDataplaneMode, selection.ModeAmbient)),
			ns("app", nil), true, selection.PodEnrolled},
		{"pod label ambient in an ambient namespace", selection.Config{}, pod("app", label(selection.LabelDataplaneMode, selection.ModeAmbient)),
			ns("app", ambient), true, selection.PodEnrolled},
		{"pod label ambient needs no namespace", selection.Config{}, pod("app", label(selection.LabelDataplaneMode, selection.ModeAmbient)),
			nil, true, selection.PodEnrolled},
		{"pod label ambient in a namespace of another mode", selection.Config{}, pod("app", label(selection.LabelDataplaneMode, selection.ModeAmbient)),
			ns("app", map[string]string{selection.LabelDataplaneMode: "sidecar"}), true, selection.PodEnrolled},
		{"isthmus pod label none opts out", selection.Config{}, pod("app", label(selection.LabelIsthmusDataplaneMode, selection.ModeNone)),
			ns("app", ambient), false, selection.PodOptOut},
		{"none on either pod label wins over ambient on the other", selection.Config{},
			pod("app", label(selection.LabelDataplaneMode, selection.ModeAmbient), label(selection.LabelIsthmusDataplaneMode, selection.ModeNone)),
			ns("app", ambient), false, selection.PodOptOut},
		{"a pod label of another value defers to the namespace", selection.Config{}, pod("app", label(selection.LabelDataplaneMode, "sidecar")),
			ns("app", ambient), true, selection.Enrolled},
		{"a pod label of another value does not enrol", selection.Config{}, pod("app", label(selection.LabelDataplaneMode, "sidecar")),
			ns("app", nil), false, selection.NamespaceNotAmbient},
		{"pod label ambient never beats an excluded namespace", selection.Config{}, pod("kube-system", label(selection.LabelDataplaneMode, selection.ModeAmbient)),
			ns("kube-system", nil), false, selection.ExcludedNamespace},
		{"pod label ambient never enrols a hostNetwork pod", selection.Config{}, pod("app", hostNetwork, label(selection.LabelDataplaneMode, selection.ModeAmbient)),
			ns("app", nil), false, selection.HostNetwork},
		{"pod label ambient never enrols a sidecar pod", selection.Config{}, pod("app", sidecar, label(selection.LabelDataplaneMode, selection.ModeAmbient)),
			ns("app", nil), false, selection.Sidecar},
		{"kube-system excluded by default even if labelled", selection.Config{}, pod("kube-system"),
			ns("kube-system", ambient), false, selection.ExcludedNamespace},
		{"control-plane namespace excluded by default", selection.Config{}, pod("isthmus-system"),
			ns("isthmus-system", ambient), false, selection.ExcludedNamespace},
		{"exclusion applies before everything", selection.Config{ExcludedNamespaces: []string{"app"}},
			pod("app", hostNetwork, sidecar), ns("app", ambient), false, selection.ExcludedNamespace},
		{"configured list replaces the default", selection.Config{ExcludedNamespaces: []string{}},
			pod("kube-system"), ns("kube-system", ambient), true, selection.Enrolled},
		{"hostNetwork never", selection.Config{}, pod("app", hostNetwork), ns("app", ambient), false, selection.HostNetwork},
		{"sidecar never", selection.Config{}, pod("app", sidecar), ns("app", ambient), false, selection.Sidecar},
		{"sidecar before opt-out", selection.Config{}, pod("app", sidecar, label(selection.LabelDataplaneMode, selection.ModeNone)),
			ns("app", ambient), false, selection.Sidecar},
		{"unknown namespace", selection.Config{}, pod("app"), nil, false, selection.NamespaceUnavailable},
		{"unknown namespace but opted out", selection.Config{}, pod("app", label(selection.LabelDataplaneMode, selection.ModeNone)),
			nil, false, selection.PodOptOut},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, reason := tc.cfg.Decide(tc.pod, tc.ns)
			require.Equal(t, tc.want, got)
			require.Equal(t, tc.reason, reason)
		})
	}
	require.True(t, selection.Config{}.Excluded("kube-system"))
	require.False(t, selection.Config{}.Excluded("app"))
	require.False(t, selection.Config{ExcludedNamespaces: []string{}}.Excluded("kube-system"))
}
