package backoff_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/isthmus-mesh/isthmus/internal/backoff"
)

func TestDelaysDoubleWithinTheUpperHalfUpToTheCap(t *testing.T) {
	b := backoff.New(100*time.Millisecond, time.Second)
	for round := range 2 {
		for i, step := range []time.Duration{100, 200, 400, 800, 1000, 1000, 1000} {
			step *= time.Millisecond
			for range 50 {
				c := b // every draw of the same step
				d := c.Next()
				require.GreaterOrEqual(t, d, step/2, "round %d attempt %d", round, i)
				require.LessOrEqual(t, d, step, "round %d attempt %d", round, i)
			}
			b.Next()
		}
		b.Reset()
	}
}

func TestDelaysAreSpread(t *testing.T) {
	b := backoff.New(time.Second, time.Second)
	seen := map[time.Duration]bool{}
	for range 20 {
		seen[b.Next()] = true
	}
	require.Greater(t, len(seen), 10, "jitter draws distinct delays")
}

func TestCapBelowInitialIsRaised(t *testing.T) {
	b := backoff.New(time.Second, time.Millisecond)
	for range 5 {
		require.LessOrEqual(t, b.Next(), time.Second)
	}
}

func TestManyAttemptsDoNotOverflow(t *testing.T) {
	b := backoff.New(time.Nanosecond, time.Hour)
	var d time.Duration
	for range 200 {
		d = b.Next()
	}
	require.GreaterOrEqual(t, d, 30*time.Minute)
	require.LessOrEqual(t, d, time.Hour)
}

func TestSleepStopsWithTheContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	require.False(t, backoff.Sleep(ctx, time.Hour))
	require.True(t, backoff.Sleep(t.Context(), time.Millisecond))
}
