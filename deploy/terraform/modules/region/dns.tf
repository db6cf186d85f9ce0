# The region's private zone <region_name>.<dns_domain>: nats-N records here;
# limiterd.<zone> is written by external-dns from the limiterd-regional
# Service. Associated with the other regions' VPCs so that their gateways
# and limiterd resolve these names.

resource "aws_route53_zone" "region" {
  name    = local.zone_name
  comment = "limiterd region ${var.region_name}"

  vpc {
    vpc_id = var.vpc_id
  }

  dynamic "vpc" {
    for_each = var.peer_vpcs
    content {
      vpc_id     = vpc.value.vpc_id
      vpc_region = vpc.value.aws_region
    }
  }

  tags = local.tags
}

resource "aws_route53_record" "nats" {
  count = var.nats_cluster_size

  zone_id = aws_route53_zone.region.zone_id
  name    = local.nats_hosts[count.index]
  type    = "A"
  ttl     = 60
  records = [aws_instance.nats[count.index].private_ip]
}
