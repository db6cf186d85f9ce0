package natsconn

import (
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
)

// ReconnectWait is the pause between two attempts to reach NATS.
const ReconnectWait = 250 * time.Millisecond

// IdentityName is the NATS identity of the daemons of role ("limiterd",
// "reconciler" or "admin", the admin API's writer) in region (none for
// admin): limiterd-us-east, reconciler-us-east, admin.
func IdentityName(role, region string) string {
	if region == "" {
		return role
	}
	return role + "-" + region
}

// InboxPrefix is the subject prefix of the replies to identity's requests
// (JetStream API answers, publish acks, fetched messages). Each identity
// may subscribe to its own alone, so none reads another's replies.
func InboxPrefix(identity string) string { return "_INBOX." + identity }

// Inbox makes a connection take its reply subjects under identity's
// InboxPrefix.
func Inbox(identity string) nats.Option { return nats.CustomInboxPrefix(InboxPrefix(identity)) }

// Connect connects to url as name, with opts (Auth.Options) after the
// defaults. It returns at once even when NATS is unreachable: the
// connection keeps trying, forever, and the daemons work without it
// meanwhile. Disconnections, reconnections and the server's asynchronous
// errors (a permissions violation among them) are logged.
func Connect(url, name string, log *slog.Logger, opts ...nats.Option) (*nats.Conn, error) {
	base := []nats.Option{nats.Name(name),
		nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true), nats.ReconnectWait(ReconnectWait),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("NATS connection lost, reconnecting", "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Info("NATS connection back", "server", nc.ConnectedUrlRedacted())
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			log.Warn("NATS error", "err", err)
		}),
	}
	return nats.Connect(url, append(base, opts...)...)
}
