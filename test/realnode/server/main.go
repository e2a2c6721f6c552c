// Command server is the test server image of test/realnode: an HTTP server
// on -listen (default :8080) that answers every request with
// "isthmus realnode server <hostname>\n" and logs "serving on <address>"
// when it starts. Two client modes run once instead (tests exec them in a
// pod): -get URL prints the body of a GET, and -whoami prints the user the
// API server authenticates the pod's service account token as (in-cluster
// config: the kubernetes Service, the mounted token and CA).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

func main() {
	listen := flag.String("listen", ":8080", "address to serve HTTP on")
	get := flag.String("get", "", "GET this URL, print the body and exit")
	whoami := flag.Bool("whoami", false, "print the user the API server sees this pod's service account as, and exit")
	flag.Parse()
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
	srv := &http.Server{
		Addr:              listen,
		ReadHeaderTimeout: 10 * time.Second,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprintf(w, "isthmus realnode server %s\n", host)
		}),
	}
	log.Printf("serving on %s", listen)
	log.Fatal(srv.ListenAndServe())
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
