// netcheck is the one program of the image the real-node tests run: `serve` answers HTTP
// (what readiness probes and Service traffic reach), `fetch` is a client pod that succeeds only
// when a URL answers, through the pod's own DNS and routes.
package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"time"
)

func serve(addr string) error {
	host, _ := os.Hostname()
	http.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	http.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "netcheck %s\n", host)
	})
	return http.ListenAndServe(addr, nil)
}

// fetch retries until the deadline: a client pod may start before the Service's rules exist.
func fetch(url string, within time.Duration) error {
	client := http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(within)
	for {
		resp, err := client.Get(url)
		if err == nil {
			body, readErr := io.ReadAll(resp.Body)
			resp.Body.Close()
			if readErr == nil && resp.StatusCode == http.StatusOK {
				fmt.Printf("%s", body)
				return nil
			}
			err = fmt.Errorf("%s answered %s (%v)", url, resp.Status, readErr)
		}
		if time.Now().After(deadline) {
			return err
		}
		fmt.Fprintln(os.Stderr, err)
		time.Sleep(200 * time.Millisecond)
	}
}

func main() {
	var err error
	switch {
	case len(os.Args) == 3 && os.Args[1] == "serve":
		err = serve(os.Args[2])
	case len(os.Args) == 3 && os.Args[1] == "fetch":
		err = fetch(os.Args[2], 60*time.Second)
	default:
		err = fmt.Errorf("usage: netcheck serve <addr> | netcheck fetch <url>")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
