# Redis Cluster (cluster mode enabled): the counters of one region.
#
# maxmemory-policy noeviction: every key limiterd writes has an expiry, so a
# volatile-* policy evicts live counters exactly like allkeys-*, and the
# evicted clients are silently admitted. With noeviction a full node refuses
# the scripts' writes, and the checks answer by their rules' on_failure.
# Memory above 70% pages before that (deploy/prometheus/alerts.yml).

resource "aws_elasticache_subnet_group" "redis" {
  name        = "${local.name}-redis"
  description = "limiterd Redis of region ${var.region_name}"
  subnet_ids  = var.subnet_ids
  tags        = local.tags
}

resource "aws_elasticache_parameter_group" "redis" {
  name        = "${local.name}-redis7-cluster"
  family      = "redis7"
  description = "limiterd: default.redis7.cluster.on with maxmemory-policy noeviction"

  parameter {
    name  = "cluster-enabled"
    value = "yes"
  }

  parameter {
    name  = "maxmemory-policy"
    value = "noeviction"
  }

  tags = local.tags

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_security_group" "redis" {
  name        = "${local.name}-redis"
  description = "limiterd Redis of region ${var.region_name}: TLS clients from limiterd and the reconcilers"
  vpc_id      = var.vpc_id
  tags        = merge(local.tags, { Name = "${local.name}-redis" })
}

resource "aws_vpc_security_group_ingress_rule" "redis_clients" {
  for_each = toset(var.client_security_group_ids)

  security_group_id            = aws_security_group.redis.id
  description                  = "Redis from limiterd and the reconcilers"
  referenced_security_group_id = each.value
  ip_protocol                  = "tcp"
  from_port                    = local.redis_port
  to_port                      = local.redis_port
  tags                         = local.tags
}

resource "aws_elasticache_replication_group" "redis" {
  replication_group_id = local.name
  description          = "limiterd counters of region ${var.region_name}"

  engine               = "redis"
  engine_version       = var.redis_engine_version
  node_type            = var.redis_node_type
  port                 = local.redis_port
  parameter_group_name = aws_elasticache_parameter_group.redis.name
  subnet_group_name    = aws_elasticache_subnet_group.redis.name
  security_group_ids   = [aws_security_group.redis.id]

  # Cluster mode: shards by the client hash tag rl:{<client>}:<rule>, each
  # primary with replicas in other zones. An asynchronous failover may lose
  # a few increments, which the accuracy budget absorbs.
  num_node_groups            = var.redis_shards
  replicas_per_node_group    = var.redis_replicas_per_shard
  automatic_failover_enabled = true
  multi_az_enabled           = true

  # limiterd: --redis.tls --redis.password-file (the Secret limiterd-redis-auth).
  transit_encryption_enabled = true
  auth_token                 = var.redis_auth_token
  auth_token_update_strategy = "ROTATE"
  at_rest_encryption_enabled = true

  # Counters are rebuilt by traffic within a refill period: no backups.
  snapshot_retention_limit   = 0
  maintenance_window         = var.redis_maintenance_window
  auto_minor_version_upgrade = true
  apply_immediately          = false

  tags = local.tags

  lifecycle {
    precondition {
      condition     = length(local.subnet_zones) >= 2
      error_message = "subnet_ids span ${length(local.subnet_zones)} availability zone(s): multi-AZ Redis needs at least 2."
    }
    precondition {
      condition     = length(local.name) <= 40
      error_message = "The replication group id ${local.name} is longer than 40 characters: shorten name_prefix or region_name."
    }
  }
}
