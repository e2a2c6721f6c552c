package proxy

import (
	"context"
	"errors"
	"time"
)

// errOvertaken is the outcome of an attempt still pending when a later
// candidate connected: the endpoint did not answer within the attempt
// delay while another did (a dead node drops the SYN). It is a failure for
// ejection, not a refusal.
var errOvertaken = errors.New("no answer before a later endpoint connected")

// attemptResult is the outcome of one connection attempt.
type attemptResult[T any] struct {
	i   int
	v   T
	err error
}

// race connects to one of n candidates, best first. Each attempt runs for
// at most timeout. The next one starts as soon as the last one started
// fails, or after delay while it is still pending (RFC 8305's connection
// attempt delay): a candidate that does not answer at all costs delay, not
// timeout. The first to succeed wins; the pending ones are cancelled, and
// any that still succeeds is closed with discard. failed is called, in
// order, for every attempt that failed, with last set for the final
// failure when all failed, and with errOvertaken for those started before
// the winner and still pending (not for later ones, which only lost the
// race). With no success, race returns the last failure's value and every
// error.
func race[T any](ctx context.Context, n int, delay, timeout time.Duration,
	try func(ctx context.Context, i int) (T, error), discard func(T), failed func(i int, err error, last bool)) (int, T, error) {
	var zero T
	if n == 0 {
		return -1, zero, errors.New("no candidate")
	}
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	results := make(chan attemptResult[T], n) // attempts never block on it
	pending := map[int]bool{}
	next := 0
	timer := time.NewTimer(delay)
	defer timer.Stop()
	launch := func() {
		i := next
		next++
		pending[i] = true
		go func() {
			tctx, tcancel := context.WithTimeout(actx, timeout)
			defer tcancel()
			v, err := try(tctx, i)
			results <- attemptResult[T]{i: i, v: v, err: err}
		}()
		timer.Reset(delay)
	}
	launch()
	var errs []error
	last := zero
	for len(pending) > 0 {
		select {
		case r := <-results:
			delete(pending, r.i)
			if r.err == nil {
				cancel()
				for j := range r.i {
					if pending[j] {
						failed(j, errOvertaken, false)
					}
				}
				if len(pending) > 0 {
					go drain(results, len(pending), discard)
				}
				return r.i, r.v, nil
			}
			errs = append(errs, r.err)
			last = r.v
			final := len(pending) == 0 && (next == n || ctx.Err() != nil)
			failed(r.i, r.err, final)
			if next < n && ctx.Err() == nil {
				launch()
			}
		case <-timer.C:
			if next < n && ctx.Err() == nil {
				launch()
			}
		}
	}
	return -1, last, errors.Join(errs...)
}

// drain waits for the left attempts of a race someone won, closing any
// that still succeeded.
func drain[T any](results <-chan attemptResult[T], left int, discard func(T)) {
	for ; left > 0; left-- {
		if r := <-results; r.err == nil {
			discard(r.v)
		}
	}
}
