// Package deploy holds no code: it is the home of the tests that validate the
// production deployment next to it, so that `go test ./...` (make test)
// catches a manifest, a Terraform module, a dashboard or an alert rule that
// no longer matches the daemons it deploys.
//
// The tests build every kustomize overlay of k8s/ and decode each object
// strictly into its Kubernetes type; parse each container's args with the
// daemon's own flag set and load its options with the daemon's own New;
// check probes, ports, selectors and network policies against what the
// daemons serve; parse the Terraform of terraform/ (and, where terraform and
// an AWS provider mirror are installed, init and validate it offline);
// check that every PromQL expression of grafana/ and prometheus/ parses and
// names only metrics the daemons export (gathered from in-process daemons) or
// a short allow-list of external ones; and run promtool over the alert rules
// and their unit tests.
package deploy
