# NATS JetStream: a cluster of nats_cluster_size servers per region, named
# after the region, that is also that region's gateway into a NATS
# supercluster linking every region. The configuration each server runs is
# deploy/nats/nats-server.conf.tftpl, rendered here; what it assumes:
#
#   - cluster name = gateway name = region_name; routes between this
#     region's servers by their DNS names (nats-N.<zone>); gateways to every
#     other region's servers (var.nats_gateways), over the VPC peering or
#     transit gateway that nats_gateway_cidr_blocks opens port 7222 to;
#   - one JetStream domain over the whole supercluster (no "domain" set), so
#     stream names are global: each region's reconcilers create their
#     LIMITER_LOCAL_<REGION>, LIMITER_SPENDS_<REGION>, LIMITER_IN_<REGION>
#     and LIMITER_RETRY_<REGION> streams, placed in their own cluster, R3
#     there (--stream.replicas=3); each LIMITER_IN_<REGION> sources the
#     other regions' LIMITER_SPENDS_<R> over the gateways, so the apply path
#     stays in the region.
#
# A configuration change does not rewrite running servers (user_data runs at
# first boot): replace them one at a time, waiting for
# /healthz?js-enabled-only=true between two, with
#   terraform apply -replace='module.<region>.aws_instance.nats[N]'

resource "aws_security_group" "nats" {
  name        = "${local.name}-nats"
  description = "limiterd NATS of region ${var.region_name}: clients, cluster routes, gateways"
  vpc_id      = var.vpc_id
  tags        = merge(local.tags, { Name = "${local.name}-nats" })
}

resource "aws_vpc_security_group_ingress_rule" "nats_clients" {
  for_each = toset(var.client_security_group_ids)

  security_group_id            = aws_security_group.nats.id
  description                  = "NATS clients: limiterd and the reconcilers"
  referenced_security_group_id = each.value
  ip_protocol                  = "tcp"
  from_port                    = local.nats_client_port
  to_port                      = local.nats_client_port
  tags                         = local.tags
}

resource "aws_vpc_security_group_ingress_rule" "nats_monitoring" {
  for_each = toset(var.client_security_group_ids)

  security_group_id            = aws_security_group.nats.id
  description                  = "NATS monitoring endpoint (healthz, varz, jsz)"
  referenced_security_group_id = each.value
  ip_protocol                  = "tcp"
  from_port                    = local.nats_monitor_port
  to_port                      = local.nats_monitor_port
  tags                         = local.tags
}

resource "aws_vpc_security_group_ingress_rule" "nats_routes" {
  security_group_id            = aws_security_group.nats.id
  description                  = "NATS cluster routes between this region's servers"
  referenced_security_group_id = aws_security_group.nats.id
  ip_protocol                  = "tcp"
  from_port                    = local.nats_cluster_port
  to_port                      = local.nats_cluster_port
  tags                         = local.tags
}

resource "aws_vpc_security_group_ingress_rule" "nats_gateways" {
  for_each = toset(var.nats_gateway_cidr_blocks)

  security_group_id = aws_security_group.nats.id
  description       = "NATS gateways of the other regions"
  cidr_ipv4         = each.value
  ip_protocol       = "tcp"
  from_port         = local.nats_gateway_port
  to_port           = local.nats_gateway_port
  tags              = local.tags
}

resource "aws_vpc_security_group_egress_rule" "nats_all" {
  security_group_id = aws_security_group.nats.id
  description       = "Routes, gateways to the other regions, DNS"
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "-1"
  tags              = local.tags
}

resource "aws_instance" "nats" {
  count = var.nats_cluster_size

  ami                    = var.nats_ami_id
  instance_type          = var.nats_instance_type
  subnet_id              = var.subnet_ids[count.index % length(var.subnet_ids)]
  vpc_security_group_ids = [aws_security_group.nats.id]

  user_data = templatefile("${path.module}/templates/nats-user-data.sh.tftpl", {
    nats_config = templatefile("${path.module}/../../../nats/nats-server.conf.tftpl", {
      server_name       = local.nats_hosts[count.index]
      region_name       = var.region_name
      client_port       = local.nats_client_port
      cluster_port      = local.nats_cluster_port
      gateway_port      = local.nats_gateway_port
      monitor_port      = local.nats_monitor_port
      routes            = local.nats_hosts
      gateways          = var.nats_gateways
      max_file_store_gb = var.nats_jetstream_max_file_gb
    })
  })

  metadata_options {
    http_tokens = "required"
  }

  root_block_device {
    volume_type = "gp3"
    volume_size = var.nats_volume_size_gb
    encrypted   = true
  }

  tags = merge(local.tags, { Name = "${local.name}-nats-${count.index}" })

  lifecycle {
    # See above: servers are replaced one at a time, by hand.
    ignore_changes = [ami, user_data]
  }
}
