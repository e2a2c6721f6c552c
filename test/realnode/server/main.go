// Command server is the test server image of test/realnode: an HTTP server
// on -listen (default :8080) that answers every request with
// "isthmus realnode server <hostname>\n".
package main

import (
	"flag"
	"fmt"
	"log"
	"net/http"
	"os"
	"time"
)

func main() {
	listen := flag.String("listen", ":8080", "address to serve HTTP on")
	flag.Parse()
	host, err := os.Hostname()
	if err != nil {
		log.Fatal(err)
	}
	srv := &http.Server{
		Addr:              *listen,
		ReadHeaderTimeout: 10 * time.Second,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprintf(w, "isthmus realnode server %s\n", host)
		}),
	}
	log.Fatal(srv.ListenAndServe())
}
