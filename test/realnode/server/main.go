// Command server is the test server image of test/realnode: an HTTP server
// on -listen (default :8080) that answers GET / with
// "isthmus realnode server <hostname>\n" (and logs "serving on <address>"
// when it starts), and makes connections from where it runs (a pod) for
// the tests:
//
//	GET /dial?addr=host:port   TCP connect: "connected"
//	GET /fetch?addr=host:port  GET http://host:port/: the body
//	GET /tls?addr=host:port    TLS handshake (no verification): the hex
//	                           SHA-256 of the peer's leaf certificate
//
// A failure is a 502 whose body is the error. Two client modes run once
// instead (tests exec them in a pod): -get URL prints the body of a GET,
// and -whoami prints the user the API server authenticates the pod's
// service account token as (in-cluster config: the kubernetes Service, the
// mounted token and CA). -traffic URL runs test/realnode/traffic's steady
// traffic to URL (-long connections, a new one every -new-every): it
// prints "ready <n>" once the long-lived connections are established, runs
// until its standard input ends, then prints the traffic.Result as JSON.
package main

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/isthmus-mesh/isthmus/test/realnode/traffic"
)

func main() {
	listen := flag.String("listen", ":8080", "address to serve HTTP on")
	get := flag.String("get", "", "GET this URL, print the body and exit")
	whoami := flag.Bool("whoami", false, "print the user the API server sees this pod's service account as, and exit")
	trafficURL := flag.String("traffic", "", "send steady traffic to this URL until stdin ends, then print what it met")
	long := flag.Int("long", 10, "-traffic: long-lived connections")
	newEvery := flag.Duration("new-every", 100*time.Millisecond, "-traffic: interval between new connections")
	flag.Parse()
	if *trafficURL != "" {
		if err := runTraffic(traffic.Config{URL: *trafficURL, Long: *long, NewEvery: *newEvery}); err != nil {
			log.Fatal(err)
		}
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	switch {
	case *get != "":
		if err := printGet(ctx, *get); err != nil {
			log.Fatal(err)
		}
	case *whoami:
		if err := printUser(ctx); err != nil {
			log.Fatal(err)
		}
	default:
		serve(*listen)
	}
}

func serve(listen string) {
	host, err := os.Hostname()
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "isthmus realnode server %s\n", host)
	})
	mux.HandleFunc("/dial", probe(dial))
	mux.HandleFunc("/fetch", probe(fetch))
	mux.HandleFunc("/tls", probe(handshake))
	srv := &http.Server{Addr: listen, ReadHeaderTimeout: 10 * time.Second, Handler: mux}
	log.Printf("serving on %s", listen)
	log.Fatal(srv.ListenAndServe())
}

// probe serves one kind of outgoing connection to the query's addr.
func probe(fn func(ctx context.Context, addr string) (string, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		addr := r.URL.Query().Get("addr")
		if _, _, err := net.SplitHostPort(addr); err != nil {
			http.Error(w, "addr: "+err.Error(), http.StatusBadRequest)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
		defer cancel()
		out, err := fn(ctx, addr)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		fmt.Fprint(w, out)
	}
}

func dial(ctx context.Context, addr string) (string, error) {
	c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	c.Close()
	return "connected", nil
}

func fetch(ctx context.Context, addr string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/", nil)
	if err != nil {
		return "", err
	}
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: %s", addr, resp.Status)
	}
	return string(body), nil
}

// handshake does a TLS handshake without verifying the peer: the caller
// compares the fingerprint with the certificate it expects.
func handshake(ctx context.Context, addr string) (string, error) {
	d := &tls.Dialer{Config: &tls.Config{InsecureSkipVerify: true}} //nolint:gosec // the test compares the fingerprint
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	certs := c.(*tls.Conn).ConnectionState().PeerCertificates
	if len(certs) == 0 {
		return "", fmt.Errorf("%s sent no certificate", addr)
	}
	sum := sha256.Sum256(certs[0].Raw)
	return hex.EncodeToString(sum[:]), nil
}

// printGet prints the body of GET url (an error unless 200).
func printGet(ctx context.Context, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	_, err = os.Stdout.Write(body)
	return err
}

// printUser asks the API server who this pod is (a SelfSubjectReview,
// which every authenticated user may create).
func printUser(ctx context.Context) error {
	cfg, err := rest.InClusterConfig()
	if err != nil {
		return err
	}
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	r, err := c.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	fmt.Println(r.Status.UserInfo.Username)
	return nil
}

// runTraffic runs the steady traffic until stdin ends.
func runTraffic(cfg traffic.Config) error {
	t, err := traffic.Start(context.Background(), cfg)
	if err != nil {
		return err
	}
	fmt.Printf("ready %d\n", cfg.Long)
	_, _ = io.Copy(io.Discard, os.Stdin)
	return json.NewEncoder(os.Stdout).Encode(t.Stop())
}
