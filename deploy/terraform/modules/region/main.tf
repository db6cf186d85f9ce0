# One limiterd region on AWS: the Redis Cluster its limiterd fleet and
# reconcilers share (ElastiCache, cluster mode, TLS, AUTH), the NATS
# JetStream cluster that is this region's gateway into the supercluster
# linking the regions (EC2), and a private DNS zone naming them. The
# Kubernetes side (deploy/k8s/overlays/<region>) takes this module's
# k8s_infra_env output as its infra.env.

locals {
  name      = "${var.name_prefix}-${var.region_name}"
  zone_name = "${var.region_name}.${var.dns_domain}"
  tags = merge(var.tags, {
    "limiterd.io/region" = var.region_name
  })

  # Names are known before anything is created, so other regions' modules
  # can take this region's gateway URLs without a dependency cycle.
  nats_hosts        = [for i in range(var.nats_cluster_size) : "nats-${i}.${local.zone_name}"]
  nats_client_port  = 4222
  nats_cluster_port = 6222
  nats_gateway_port = 7222
  nats_monitor_port = 8222
  redis_port        = 6379
}

data "aws_subnet" "selected" {
  for_each = toset(var.subnet_ids)
  id       = each.value
}

locals {
  subnet_zones = distinct([for s in data.aws_subnet.selected : s.availability_zone])
}
