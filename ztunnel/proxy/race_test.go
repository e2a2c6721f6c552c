package proxy

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// raceRecorder collects what race reports through failed and discard.
type raceRecorder struct {
	mu        sync.Mutex
	failures  []string
	discarded []int
}

func (r *raceRecorder) failed(i int, err error, last bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failures = append(r.failures, fmt.Sprintf("%d:%v:%v", i, err, last))
}

func (r *raceRecorder) discard(v int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.discarded = append(r.discarded, v)
}

func (r *raceRecorder) got() ([]string, []int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.failures...), append([]int(nil), r.discarded...)
}

var errRefused = errors.New("refused")

// TestRaceStartsTheNextOnFailure: with an attempt delay of an hour, a
// candidate that fails hands over to the next at once; when all fail,
// each failure is reported, the last one flagged, and every error returned.
func TestRaceStartsTheNextOnFailure(t *testing.T) {
	var rec raceRecorder
	i, v, err := race(t.Context(), 3, time.Hour, time.Hour, func(_ context.Context, i int) (int, error) {
		if i < 2 {
			return 10 + i, errRefused
		}
		return 10 + i, nil
	}, rec.discard, rec.failed)
	require.NoError(t, err)
	require.Equal(t, 2, i)
	require.Equal(t, 12, v)
	failures, _ := rec.got()
	require.Equal(t, []string{"0:refused:false", "1:refused:false"}, failures)

	rec = raceRecorder{}
	i, v, err = race(t.Context(), 2, time.Hour, time.Hour, func(_ context.Context, i int) (int, error) {
		return 10 + i, fmt.Errorf("candidate %d: %w", i, errRefused)
	}, rec.discard, rec.failed)
	require.Equal(t, -1, i)
	require.Equal(t, 11, v, "the last failure's value")
	require.ErrorContains(t, err, "candidate 0")
	require.ErrorContains(t, err, "candidate 1")
	failures, _ = rec.got()
	require.Equal(t, []string{"0:candidate 0: refused:false", "1:candidate 1: refused:true"}, failures)
}

// TestRaceOvertakesASilentCandidate: a candidate that never answers (its
// timeout is an hour) is overtaken after the attempt delay by the next,
// which wins; the silent attempt is cancelled and reported as overtaken,
// as is the second, still pending too, which is closed when it connects
// anyway.
func TestRaceOvertakesASilentCandidate(t *testing.T) {
	var rec raceRecorder
	silentEnd := make(chan error, 1)
	release := make(chan struct{})
	type result struct {
		i, v int
		err  error
	}
	done := make(chan result, 1)
	go func() {
		i, v, err := race(t.Context(), 3, time.Millisecond, time.Hour, func(ctx context.Context, i int) (int, error) {
			switch i {
			case 0: // silent
				<-ctx.Done()
				silentEnd <- ctx.Err()
				return 0, ctx.Err()
			case 1: // answers once the third is under way, ignoring its context
				<-release
				return 11, nil
			default: // wins
				return 12, nil
			}
		}, rec.discard, rec.failed)
		done <- result{i, v, err}
	}()
	var r result
	select {
	case r = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the race waited for the silent candidate")
	}
	require.NoError(t, r.err)
	require.Equal(t, 2, r.i)
	require.Equal(t, 12, r.v)
	require.ErrorIs(t, <-silentEnd, context.Canceled)
	close(release)
	require.Eventually(t, func() bool {
		_, discarded := rec.got()
		return len(discarded) == 1
	}, 10*time.Second, time.Millisecond)
	failures, discarded := rec.got()
	require.Equal(t, []int{11}, discarded, "the late success is closed")
	require.Equal(t, []string{"0:" + errOvertaken.Error() + ":false", "1:" + errOvertaken.Error() + ":false"}, failures)
}
