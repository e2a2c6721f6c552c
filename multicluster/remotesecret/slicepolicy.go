package remotesecret

import (
	"context"
	"fmt"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// ImportedSliceManagedBy is the endpointslice.kubernetes.io/managed-by
// value of the imported EndpointSlices pilot writes beside ServiceImports
// (pilot/mcs.SliceManagedBy): the only EndpointSlices its identity may
// write.
const ImportedSliceManagedBy = "mcs-controller.isthmus.io"

// SlicePolicyName is the name of the ValidatingAdmissionPolicy (and its
// binding) that confines the EndpointSlice writes of the reader of
// control-plane namespace namespace.
func SlicePolicyName(namespace string) string { return "isthmus-imported-endpointslices-" + namespace }

// The policy's CEL: RBAC cannot grant EndpointSlice writes by label, and a
// slice labelled kubernetes.io/service-name feeds every proxy of a
// Service, so without it a leaked remote kubeconfig could steer any
// Service's traffic. A created or updated slice must carry the managed-by
// value and no kubernetes.io/service-name; an updated or deleted one must
// have carried the managed-by value.
const (
	sliceNewExpr = `request.operation == 'DELETE' || (has(object.metadata.labels) && ` +
		`'endpointslice.kubernetes.io/managed-by' in object.metadata.labels && ` +
		`object.metadata.labels['endpointslice.kubernetes.io/managed-by'] == '` + ImportedSliceManagedBy + `' && ` +
		`!('kubernetes.io/service-name' in object.metadata.labels))`
	sliceOldExpr = `request.operation == 'CREATE' || (has(oldObject.metadata.labels) && ` +
		`'endpointslice.kubernetes.io/managed-by' in oldObject.metadata.labels && ` +
		`oldObject.metadata.labels['endpointslice.kubernetes.io/managed-by'] == '` + ImportedSliceManagedBy + `')`
)

// SlicePolicy returns the ValidatingAdmissionPolicy and binding that let
// ServiceAccount namespace/serviceAccount write only imported
// EndpointSlices (ImportedSliceManagedBy, never kubernetes.io/service-name).
// Other users are not matched.
func SlicePolicy(namespace, serviceAccount string) (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
	name := SlicePolicyName(namespace)
	fail := admissionv1.Fail
	forbidden := metav1.StatusReasonForbidden
	policy := &admissionv1.ValidatingAdmissionPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: &fail,
			MatchConstraints: &admissionv1.MatchResources{ResourceRules: []admissionv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionv1.RuleWithOperations{
					Operations: []admissionv1.OperationType{admissionv1.Create, admissionv1.Update, admissionv1.Delete},
					Rule: admissionv1.Rule{APIGroups: []string{"discovery.k8s.io"}, APIVersions: []string{"*"},
						Resources: []string{"endpointslices"}},
				},
			}}},
			MatchConditions: []admissionv1.MatchCondition{{Name: "pilot-reader",
				Expression: fmt.Sprintf("request.userInfo.username == 'system:serviceaccount:%s:%s'", namespace, serviceAccount)}},
			Validations: []admissionv1.Validation{
				{Expression: sliceNewExpr, Reason: &forbidden,
					Message: "pilot may write only EndpointSlices labelled endpointslice.kubernetes.io/managed-by=" + ImportedSliceManagedBy + " without kubernetes.io/service-name"},
				{Expression: sliceOldExpr, Reason: &forbidden,
					Message: "pilot may change only EndpointSlices labelled endpointslice.kubernetes.io/managed-by=" + ImportedSliceManagedBy},
			},
		},
	}
	binding := &admissionv1.ValidatingAdmissionPolicyBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: name,
			ValidationActions: []admissionv1.ValidationAction{admissionv1.Deny}},
	}
	return policy, binding
}

// ensureSlicePolicy creates (or updates) the reader's SlicePolicy.
func ensureSlicePolicy(ctx context.Context, c kubernetes.Interface, opts ReaderOptions) error {
	policy, binding := SlicePolicy(opts.Namespace, opts.ServiceAccount)
	if err := ensureUpdate(ctx, c.AdmissionregistrationV1().ValidatingAdmissionPolicies(), policy,
		func(cur *admissionv1.ValidatingAdmissionPolicy) { cur.Spec = policy.Spec }); err != nil {
		return fmt.Errorf("validating admission policy: %w", err)
	}
	if err := ensureUpdate(ctx, c.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings(), binding,
		func(cur *admissionv1.ValidatingAdmissionPolicyBinding) { cur.Spec = binding.Spec }); err != nil {
		return fmt.Errorf("validating admission policy binding: %w", err)
	}
	return nil
}
