// Command reconciler publishes this region's spends to NATS JetStream and
// applies the other regions' spends. It is not built yet.
package main

import (
	"fmt"
	"os"
)

func main() { os.Exit(run()) }

func run() int {
	fmt.Fprintln(os.Stderr, "reconciler: not built yet; limiterd enforces every limit per region on its own")
	return 1
}
