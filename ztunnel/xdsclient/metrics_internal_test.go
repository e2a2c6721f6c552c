package xdsclient

import (
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestTerminationReason proves how a stream's end is classified.
func TestTerminationReason(t *testing.T) {
	require.Equal(t, TerminationConnectionError, terminationReason(connectError{fmt.Errorf("open stream: %w", status.Error(codes.Unavailable, "refused"))}))
	require.Equal(t, TerminationReconnect, terminationReason(fmt.Errorf("receive: %w", io.EOF)))
	require.Equal(t, TerminationError, terminationReason(fmt.Errorf("receive: %w", status.Error(codes.Unavailable, "transport closing"))))
	require.Equal(t, TerminationError, terminationReason(errors.New("send ack: no stream")))
}
