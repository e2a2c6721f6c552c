package xds

import (
	"context"
	"fmt"
	"log/slog"

	gcplog "github.com/envoyproxy/go-control-plane/pkg/log"
)

// slogAdapter adapts an slog.Logger to go-control-plane's logger interface.
// go-control-plane logs every watch it opens at info level, so its info
// messages go to slog's debug level; warnings and errors keep their level.
type slogAdapter struct{ l *slog.Logger }

var _ gcplog.Logger = slogAdapter{}

func (a slogAdapter) logf(level slog.Level, format string, args []any) {
	if !a.l.Enabled(context.Background(), level) {
		return
	}
	a.l.Log(context.Background(), level, fmt.Sprintf(format, args...))
}

// Debugf logs at debug level.
func (a slogAdapter) Debugf(format string, args ...any) { a.logf(slog.LevelDebug, format, args) }

// Infof logs at debug level (see slogAdapter).
func (a slogAdapter) Infof(format string, args ...any) { a.logf(slog.LevelDebug, format, args) }

// Warnf logs at warn level.
func (a slogAdapter) Warnf(format string, args ...any) { a.logf(slog.LevelWarn, format, args) }

// Errorf logs at error level.
func (a slogAdapter) Errorf(format string, args ...any) { a.logf(slog.LevelError, format, args) }
