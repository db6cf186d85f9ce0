// Command pacer is a pacing process of limiterd's pacing proof test
// (TestPacerProof in internal/limiterd): paceWorkers goroutines share one
// client.Pacer of the rule partner and send, after each Wait, a GET to the
// partner (LIMITERD_PARTNER) until the instant on the go line; then it
// prints one "sent <unix ns>" line per call, and "done". Each call names
// its instant (?sent=) so that the partner can tell its delivery time. It is built
// without the race detector, as users run a pacing process.
package main

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/limiterd/limiterd/pkg/client"
)

// paceWorkers are the goroutines of each pacing process, each one call at
// a time: 3 processes of 4 keep the rule's queue busy.
const paceWorkers = 4

// maxLate is below the rule's spacing (10 ms): a call that could leave
// more than this after its slot gives the slot up instead. Then a window
// of the partner holds at most the slots of a window 9 ms longer: 2 in
// 10 ms (19 ms of slots 10 ms apart), 101 in 1 s.
const maxLate = 9 * time.Millisecond

func main() {
	c, err := client.New(os.Getenv("LIMITERD_ADDR"), client.WithTimeout(2*time.Second))
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(0)
	}
	ctx := context.Background()
	// The connection is up before the start.
	if _, err := c.Check(ctx, "partner", "warm-"+os.Getenv("LIMITERD_KEY"), 1); err != nil {
		fmt.Println("error:", err)
		os.Exit(0)
	}
	partner := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: paceWorkers}}
	// Each worker's connection to the partner is open before the start
	// (a warm-up call the partner does not count).
	var warm sync.WaitGroup
	for range paceWorkers {
		warm.Go(func() {
			if resp, err := partner.Get(os.Getenv("LIMITERD_PARTNER") + "/warm"); err == nil {
				resp.Body.Close()
			}
		})
	}
	warm.Wait()
	fmt.Println("ready")
	line, _ := bufio.NewReader(os.Stdin).ReadString('\n')
	end, err := strconv.ParseInt(strings.TrimSpace(strings.TrimPrefix(line, "go ")), 10, 64)
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(0)
	}
	p := client.NewPacer(c, "partner", os.Getenv("LIMITERD_KEY"), client.PacerOptions{MaxWait: time.Second, MaxLate: maxLate})
	var mu sync.Mutex
	var sent []int64
	var errs []string
	var wg sync.WaitGroup
	for range paceWorkers {
		wg.Go(func() {
			wctx, cancel := context.WithDeadline(ctx, time.Unix(0, end))
			defer cancel()
			for {
				if err := p.Wait(wctx); err != nil {
					if wctx.Err() == nil {
						mu.Lock()
						errs = append(errs, err.Error())
						mu.Unlock()
					}
					return
				}
				at := time.Now().UnixNano()
				resp, err := partner.Get(os.Getenv("LIMITERD_PARTNER") + "/?sent=" + strconv.FormatInt(at, 10))
				mu.Lock()
				sent = append(sent, at)
				if err != nil {
					errs = append(errs, err.Error())
				}
				mu.Unlock()
				if err == nil {
					resp.Body.Close()
				}
			}
		})
	}
	wg.Wait()
	w := bufio.NewWriter(os.Stdout)
	for _, e := range errs {
		fmt.Fprintln(w, "error:", strings.ReplaceAll(e, "\n", " "))
	}
	for _, at := range sent {
		fmt.Fprintln(w, "sent", at)
	}
	fmt.Fprintln(w, "missed", p.Missed())
	fmt.Fprintln(w, "done")
	w.Flush()
	os.Exit(0)
}
