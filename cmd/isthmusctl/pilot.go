package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// pilotClient reads JSON from pilot's debug server.
type pilotClient struct {
	base string
	http *http.Client
}

func newPilotClient(base string, timeout time.Duration) *pilotClient {
	return &pilotClient{base: strings.TrimRight(base, "/"), http: &http.Client{Timeout: timeout}}
}

// errNotServed is returned (wrapped) when pilot answers 404 for a path.
var errNotServed = errors.New("not served by this pilot")

// get fetches path and decodes its JSON body into out.
func (p *pilotClient) get(ctx context.Context, path string, out any) error {
	url := p.base + path
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("pilot URL %q: %w", p.base, err)
	}
	req.Header.Set("Accept", "application/json")
	resp, err := p.http.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s (is pilot's debug server reachable? port-forward it or set --pilot): %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusNotFound {
		return fmt.Errorf("GET %s: %w", url, errNotServed)
	}
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, strings.TrimSpace(string(msg)))
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("GET %s: decode JSON: %w", url, err)
	}
	return nil
}
