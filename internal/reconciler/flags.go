package reconciler

import (
	"flag"

	"github.com/limiterd/limiterd/internal/natsconn"
)

// RegisterFlags defines the reconciler's flags on fs, writing into o.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	d := DefaultOptions()
	fs.StringVar(&o.Region, "region", d.Region, "name of this region (required; must be in the topology)")
	fs.StringVar(&o.TopologyFile, "region.topology-file", d.TopologyFile, "YAML list of the regions (required)")
	fs.DurationVar(&o.TopologyPoll, "region.topology-poll", d.TopologyPoll, "how often --region.topology-file is read again; a changed file is checked and put in force at its effective_at")
	fs.StringVar(&o.RulesFile, "rules.file", d.RulesFile, "YAML rules file, the same as limiterd's (required)")
	fs.IntVar(&o.MaxRules, "rules.max-rules", d.MaxRules, "most rules in force, the file's and the admin API's together; more are refused (as limiterd's)")
	fs.StringVar(&o.NATSURL, "nats.url", d.NATSURL, "NATS server holding the spend streams (required)")
	o.NATSAuth.RegisterFlags(fs, natsconn.FlagPrefix, true)
	o.Redis.RegisterFlags(fs, "comma-separated Redis Cluster seed addresses of this region (required)")
	fs.DurationVar(&o.Interval, "gossip.interval", d.Interval, "longest wait for a spend message before looking again")
	fs.DurationVar(&o.AckWait, "gossip.ack-wait", d.AckWait, "time before an unacknowledged message of the relay's or the retry stream's consumer is delivered again")
	fs.IntVar(&o.MaxMessageBytes, "gossip.max-message-bytes", d.MaxMessageBytes, "largest spend message accepted")
	fs.DurationVar(&o.StreamMaxAge, "stream.max-age", d.StreamMaxAge, "oldest spend message kept (the longest partition whose spends still apply)")
	fs.Int64Var(&o.StreamMaxBytes, "stream.max-bytes", d.StreamMaxBytes, "largest size of each spend stream")
	fs.IntVar(&o.StreamReplicas, "stream.replicas", d.StreamReplicas, "replicas of the spend streams in the NATS cluster")
	fs.IntVar(&o.Partitions, "apply.partitions", d.Partitions, "partitions of each region's spends, each applied in order by one reconciler at a time; the same in every region")
	fs.DurationVar(&o.LeaseTTL, "apply.lease-ttl", d.LeaseTTL, "how long a reconciler's lease of a partition lives unrenewed: how long a dead reconciler's partitions wait for another; the TTL of the region's bucket of leases when this reconciler makes it")
	fs.DurationVar(&o.ClockAllowance, "apply.clock-allowance", d.ClockAllowance, "how far another region's clock may run behind this region's Redis: a spend counts as admitted that much later, so a debit is skipped as refilled only when it surely refilled")
	fs.StringVar(&o.HTTPAddress, "http.listen-address", d.HTTPAddress, "address serving /metrics, /healthz and /readyz")
	o.Trace.RegisterFlags(fs)
}
