// Package backoff is the one retry delay of Isthmus: it doubles from an
// initial delay up to a cap, draws each delay uniformly from its upper half
// (so retries spread out yet never exceed the cap), and starts over after a
// success. It is apimachinery's wait.Backoff and wait.Jitter with the house
// parameters, so every retry loop in the project reads the same.
package backoff

import (
	"context"
	"math"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// Backoff hands out successive retry delays. The zero value is not usable;
// make one with New. It is not safe for concurrent use.
type Backoff struct {
	initial, max time.Duration
	steps        wait.Backoff
}

// New returns a Backoff whose first delay is at most initial and whose
// delays never exceed maxDelay (raised to initial if smaller). initial must be
// positive.
func New(initial, maxDelay time.Duration) Backoff {
	b := Backoff{initial: initial, max: max(maxDelay, initial)}
	b.Reset()
	return b
}

// Next returns the delay before the next attempt: the current step d (the
// initial delay doubled once per earlier call, capped) drawn from [d/2, d].
func (b *Backoff) Next() time.Duration {
	d := b.steps.Step()
	return wait.Jitter(d/2, 1)
}

// Reset starts over from the initial delay, after a success.
func (b *Backoff) Reset() {
	b.steps = wait.Backoff{Duration: b.initial, Factor: 2, Cap: b.max, Steps: math.MaxInt32}
}

// Sleep waits for d or until ctx ends, and reports whether the full delay
// passed.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
