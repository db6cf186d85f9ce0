output "region_name" {
  description = "The limiterd region name (--region, the topology's name)."
  value       = var.region_name
}

output "redis_configuration_endpoint" {
  description = "host:port of the Redis Cluster's configuration endpoint: limiterd's and the reconciler's --redis.addrs."
  value       = "${aws_elasticache_replication_group.redis.configuration_endpoint_address}:${local.redis_port}"
}

output "redis_security_group_id" {
  description = "Security group of the Redis nodes."
  value       = aws_security_group.redis.id
}

output "nats_url" {
  description = "Comma-separated nats:// URLs of the region's NATS servers: limiterd's and the reconciler's --nats.url."
  value       = join(",", [for h in local.nats_hosts : "nats://${h}:${local.nats_client_port}"])
}

output "nats_gateway_urls" {
  description = "This region's NATS gateway URLs, for the other regions' nats_gateways input."
  value       = [for h in local.nats_hosts : "nats://${h}:${local.nats_gateway_port}"]
}

output "nats_security_group_id" {
  description = "Security group of the NATS servers."
  value       = aws_security_group.nats.id
}

output "dns_zone_id" {
  description = "Route 53 private zone of the region; external-dns writes limiterd's name there."
  value       = aws_route53_zone.region.zone_id
}

output "limiterd_address" {
  description = "The region's limiterd address in the topology (deploy/k8s/overlays/*/topology.yml): the limiterd-regional Service, named by external-dns."
  value       = "limiterd.${local.zone_name}:8081"
}

output "k8s_infra_env" {
  description = "The overlay's infra.env (deploy/k8s/overlays/<region>/infra.env): the Redis and NATS addresses the manifests expand into their args."
  value = templatefile("${path.module}/templates/k8s-infra.env.tftpl", {
    region_name = var.region_name
    redis_addrs = "${aws_elasticache_replication_group.redis.configuration_endpoint_address}:${local.redis_port}"
    nats_url    = join(",", [for h in local.nats_hosts : "nats://${h}:${local.nats_client_port}"])
  })
}

output "images" {
  description = "The images the region's Deployments run, by container (deploy/k8s/base/kustomization.yaml, images:): set newName and newTag, or a digest, in the overlay when they differ from the base's."
  value = {
    limiterd   = "${var.image_registry}/limiterd:${var.image_version}"
    reconciler = "${var.image_registry}/reconciler:${var.image_version}"
  }
}
