package natsconn

import (
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
)

// ReconnectWait is the pause between two attempts to reach NATS.
const ReconnectWait = 250 * time.Millisecond

// Connect connects to url as name. It returns at once even when NATS is
// unreachable: the connection keeps trying, forever, and the daemons work
// without it meanwhile. Disconnections and reconnections are logged.
func Connect(url, name string, log *slog.Logger) (*nats.Conn, error) {
	return nats.Connect(url, nats.Name(name),
		nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true), nats.ReconnectWait(ReconnectWait),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("NATS connection lost, reconnecting", "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Info("NATS connection back", "server", nc.ConnectedUrlRedacted())
		}),
	)
}
