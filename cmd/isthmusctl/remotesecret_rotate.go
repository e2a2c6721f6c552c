package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/isthmus-mesh/isthmus/internal/cmdutil"
	"github.com/isthmus-mesh/isthmus/multicluster"
	"github.com/isthmus-mesh/isthmus/multicluster/remotesecret"
)

// rotatePoll is how often pilot's cluster status is read while waiting for
// it to serve the new credential.
const rotatePoll = 200 * time.Millisecond

// rotateRemoteSecret replaces the token of the existing remote Secret of
// cfg.Name, make-before-break: a new token (its own token Secret in the
// remote), the remote Secret updated in the primary, a wait until pilot
// serves the cluster with a generation built from that write, and only then
// the old token revoked (its token Secret deleted). If pilot does not get
// there, nothing is revoked and both tokens keep working.
func rotateRemoteSecret(ctx context.Context, cfg createRemoteSecretConfig, out io.Writer, log *slog.Logger) error {
	remote, err := cmdutil.RestConfig(cfg.Kubeconfig, cfg.Context)
	if err != nil {
		return fmt.Errorf("remote cluster: %w", err)
	}
	primary, pc, err := primaryClient(cfg, remote)
	if err != nil {
		return err
	}
	name := remotesecret.Secret(cfg.Name, cfg.Namespace, nil).Name
	cur, err := pc.CoreV1().Secrets(cfg.Namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return fmt.Errorf("no remote Secret %s/%s in the primary to rotate: create it first (without --rotate)", cfg.Namespace, name)
	}
	if err != nil {
		return fmt.Errorf("read remote Secret %s/%s: %w", cfg.Namespace, name, err)
	}
	kc, ok := cur.Data[cfg.Name]
	if !ok {
		return fmt.Errorf("remote Secret %s/%s has no key %q: it does not register cluster %s", cfg.Namespace, name, cfg.Name, cfg.Name)
	}
	server, oldToken, err := remotesecret.KubeconfigCredentials(kc)
	if err != nil {
		return fmt.Errorf("remote Secret %s/%s: %w", cfg.Namespace, name, err)
	}
	if cfg.Server == "" {
		cfg.Server = server // keep the server pilot uses
	}
	oldSecret, oldErr := remotesecret.TokenSecret(oldToken)

	pilot := newPilotClient(cfg.Pilot, cfg.PilotTimeout)
	if _, err := clusterStatus(ctx, pilot, cfg.Name); err != nil {
		return fmt.Errorf("before rotating: %w", err)
	}

	var fresh remotesecret.Token
	_, secret, rc, err := readerSecret(ctx, cfg, log, func(ctx context.Context, c kubernetes.Interface, opts remotesecret.ReaderOptions) (remotesecret.Token, error) {
		if err := remotesecret.EnsureReaderIdentity(ctx, c, opts); err != nil {
			return remotesecret.Token{}, err
		}
		fresh, err = remotesecret.NewToken(ctx, c, opts)
		return fresh, err
	})
	if err != nil {
		return err
	}
	_, rv, err := applySecret(ctx, pc, secret)
	if err != nil {
		return fmt.Errorf("write Secret %s/%s to the primary cluster: %w (the new token Secret %s/%s in the remote is unused)",
			cfg.Namespace, name, err, cfg.Namespace, fresh.Secret)
	}
	if _, err := fmt.Fprintf(out, "secret/%s updated in namespace %s of the primary cluster (%s) with a new token (token Secret %s/%s in the remote)\n",
		name, cfg.Namespace, primary.Host, cfg.Namespace, fresh.Secret); err != nil {
		return err
	}
	st, err := waitServing(ctx, pilot, cfg.Name, rv)
	if err != nil {
		return fmt.Errorf("%w; the old token is NOT revoked (both tokens work): rerun --rotate once pilot serves the cluster", err)
	}
	if _, err := fmt.Fprintf(out, "pilot serves cluster %s with it (generation %d, %s)\n", cfg.Name, st.Generation, st.State); err != nil {
		return err
	}
	if oldErr != nil {
		return fmt.Errorf("rotated, but the old token cannot be revoked: %w; it ends when it expires or when ServiceAccount %s/isthmus-reader-service-account is recreated",
			oldErr, cfg.Namespace)
	}
	if err := remotesecret.RevokeToken(ctx, rc, cfg.Namespace, oldSecret); err != nil {
		return fmt.Errorf("rotated, but revoking the old token failed: %w", err)
	}
	_, err = fmt.Fprintf(out, "old token revoked: token Secret %s/%s deleted in the remote\n", cfg.Namespace, oldSecret)
	return err
}

// clusterStatus returns pilot's status of cluster id (/debug/clusterz).
func clusterStatus(ctx context.Context, pilot *pilotClient, id string) (multicluster.Status, error) {
	var all []multicluster.Status
	if err := pilot.get(ctx, "/debug/clusterz", &all); err != nil {
		return multicluster.Status{}, err
	}
	for _, s := range all {
		if string(s.ID) == id {
			return s, nil
		}
	}
	return multicluster.Status{}, fmt.Errorf("pilot at %s does not know cluster %s: --pilot must name the pilot that reads the remote Secret", pilot.base, id)
}

// waitServing waits until pilot serves cluster id with a generation built
// from the remote Secret at resourceVersion rv, synced, with no replacement
// pending; it returns that status.
func waitServing(ctx context.Context, pilot *pilotClient, id, rv string) (multicluster.Status, error) {
	t := time.NewTicker(rotatePoll)
	defer t.Stop()
	var last multicluster.Status
	var lastErr error
	for {
		st, err := clusterStatus(ctx, pilot, id)
		if err == nil && st.SecretResourceVersion == rv && st.State == multicluster.StateSynced && st.Pending == nil {
			return st, nil
		}
		if err == nil {
			last = st
		}
		lastErr = err
		select {
		case <-ctx.Done():
			if lastErr != nil && !errors.Is(lastErr, context.DeadlineExceeded) && !errors.Is(lastErr, context.Canceled) {
				return last, fmt.Errorf("pilot did not serve cluster %s with the new credential: %w", id, lastErr)
			}
			return last, fmt.Errorf("pilot did not serve cluster %s with the new credential before the timeout (serving: generation %d, secret version %q, %s %s)",
				id, last.Generation, last.SecretResourceVersion, last.State, last.Reason)
		case <-t.C:
		}
	}
}
